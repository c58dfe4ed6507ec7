#!/usr/bin/env bash
# Real SGLang prefill/decode through handoff's SGLang backend (python/handoff/sglang.py), on
# CPU, without a GPU or a model download; and the same prompts through SGLang's mooncake TCP
# backend, side by side (both pairs up at once, their requests taking turns).
#
#   scripts/sglang-e2e.sh            set up (idempotent, cached) and run every check
#   scripts/sglang-e2e.sh --setup    set up only
#
# The venv lives outside the repo, in $HANDOFF_SGLANG_DIR (default ~/.cache/handoff/sglang):
# torch 2.14.1 from PyPI (its CUDA build runs on CPU), sglang 0.5.23 without its
# dependencies (several are CUDA-only) plus the rest pinned in scripts/sglang-requirements.txt,
# mooncake-transfer-engine-non-cuda (the reference backend) and this repository's package.
# First run: ~4 min and ~7 GB; later runs reinstall only the handoff package.
#
# Two test-rig shims, for this CPU-only machine and never for production, live in the venv's
# folder: a stand-in `sgl_kernel` (its CPU build is not on PyPI; on a CPU without AMX SGLang
# takes pure-torch paths, and the stand-in raises if anything is called), and an SGLang plugin
# that turns off the mooncake sender's host-index path (it needs CUDA events) and keeps NCCL
# out of the pipeline-parallel group (SGLang 0.5.23 asks for it even on CPU).
# Exit status: 0 when every check passed, 1 otherwise; 2 when setup failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
D=${HANDOFF_SGLANG_DIR:-$HOME/.cache/handoff/sglang}
PY=$D/venv/bin/python
PIP=$D/venv/bin/pip
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.2
MOONCAKE_VERSION=0.3.13.post1

write_shims() {
  mkdir -p "$D/shims/sgl_kernel" "$D/testrig/handoff_testrig"
  cat > "$D/shims/sgl_kernel/__init__.py" <<'EOF'
"""Test rig only: stands in for sgl-kernel's CPU build, which PyPI does not carry. Any kernel
looked up here raises when called, so a path that needs one fails loudly."""
__version__ = "0.0.0+handoff-testrig"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available on this CPU test rig")

    return missing
EOF
  cat > "$D/testrig/pyproject.toml" <<'EOF'
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"
[project]
name = "handoff-sglang-testrig"
version = "0.1.0"
[project.entry-points."sglang.srt.plugins"]
handoff_testrig = "handoff_testrig:register"
EOF
  cat > "$D/testrig/handoff_testrig/__init__.py" <<'EOF'
"""Test rig only, for a CPU-only machine.

1. SGLang's mooncake sender moves page indices through pinned memory and CUDA events when it
   says it supports host tensor indices; on a CPU-only machine it must not.
2. SGLang 0.5.23 builds its pipeline-parallel group with NCCL whatever the device, so
   --pp-size 2 cannot start on CPU; without a GPU the group uses gloo (torch.distributed's
   CPU backend) alone.
"""

VERSION = 2


def register():
    import torch
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    from sglang.srt.distributed import parallel_state

    MooncakeKVSender.supports_host_tensor_indices = False
    if torch.cuda.is_available() or getattr(parallel_state, "_handoff_testrig", False):
        return
    original = parallel_state.init_model_parallel_group

    def cpu_group(*args, **kwargs):
        kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    parallel_state.init_model_parallel_group = cpu_group
    parallel_state._handoff_testrig = True
EOF
}

setup_sglang() {
  mkdir -p "$D"
  [ -x "$PY" ] || python3 -m venv "$D/venv"
  write_shims
  if PYTHONPATH="$D/shims" "$PY" -c "import sglang.srt.disaggregation.mooncake.conn, handoff_testrig as t; assert t.VERSION == 2" 2>/dev/null; then
    return 0
  fi
  if PYTHONPATH="$D/shims" "$PY" -c "import sglang.srt.disaggregation.mooncake.conn" 2>/dev/null; then
    # SGLang is there; only the test rig is new.
    timeout 300 "$PIP" install -q --no-build-isolation --force-reinstall --no-deps "$D/testrig"
    return 0
  fi
  echo "sglang-e2e: installing torch $TORCH_VERSION, sglang $SGLANG_VERSION, mooncake into $D (first run only)"
  timeout 1500 "$PIP" install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
  timeout 600 "$PIP" install -q --no-deps "sglang==$SGLANG_VERSION"
  timeout 1500 "$PIP" install -q -r "$ROOT/scripts/sglang-requirements.txt"
  timeout 600 "$PIP" install -q "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
  timeout 300 "$PIP" install -q --no-build-isolation "$D/testrig"
  PYTHONPATH="$D/shims" "$PY" -c "import sglang.srt.disaggregation.mooncake.conn, handoff_testrig"
}

setup_handoff() {
  # The package (built by maturin from python/), which carries the SGLang plugin.
  # The workspace's target folder keeps the release build incremental across runs.
  "$PIP" install -q maturin >/dev/null
  CARGO_TARGET_DIR="$ROOT/target" "$PIP" install -q --force-reinstall --no-deps "$ROOT/python"
}

if ! setup_sglang; then echo "sglang-e2e: SGLang setup failed" >&2; exit 2; fi
if ! setup_handoff; then echo "sglang-e2e: installing the handoff package failed" >&2; exit 2; fi
[ "${1:-}" = "--setup" ] && { echo "sglang-e2e: ready in $D"; exit 0; }

exec "$PY" "$ROOT/scripts/sglang_e2e.py" --dir "$D" "$@"
