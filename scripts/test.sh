#!/usr/bin/env bash
# Sets up what the tests need and runs every test: the Rust workspace, the Python package
# (python/run-tests.sh: a cached venv, `pip install ./python`, ruff, pytest) and real vLLM
# prefill/decode through the connector (scripts/vllm-e2e.sh) and real SGLang prefill/decode
# through the backend (scripts/sglang-e2e.sh), each in a cached venv outside the repo.
# Idempotent; fast on a warm machine. .ci/run calls it.
#
#   scripts/test.sh
#
# No test passes by skipping its real part: one that cannot run it here fails, unless
# HANDOFF_SKIP (comma-separated) names what it lacks: `ucx`, `gpu`, `netns` (root, ip, nft),
# `pyzmq`, `lan` (an interface besides loopback), `promtool`, `etcd`. Unset, it is `gpu`. It can also name `vllm`
# and `sglang`, to leave out those end-to-end runs (~5 and ~7 GB and a few minutes each the
# first time). The run ends with one line saying what was skipped and why, never silently.
set -euo pipefail
cd "$(dirname "$0")/.."
export HANDOFF_SKIP="${HANDOFF_SKIP-gpu}"
skip=",${HANDOFF_SKIP},"
skipped=()
# Each skipped test appends `need<TAB>test<TAB>why` here (handoff_testkit, conftest.py).
HANDOFF_SKIP_LOG="$(mktemp -t handoff-skips.XXXXXX)"
export HANDOFF_SKIP_LOG
said() {
  local tests=""
  if [ -s "$HANDOFF_SKIP_LOG" ]; then
    tests=$(awk -F'\t' '{ n[$1]++; if (!($1 in why)) why[$1] = $3 }
      END { for (k in n) printf "%s%s: %d test(s), e.g. %s", (i++ ? "; " : ""), k, n[k], why[k] }' \
      "$HANDOFF_SKIP_LOG")
  fi
  local line="" part
  for part in "${skipped[@]}" ${tests:+"$tests"}; do
    line="${line:+$line; }$part"
  done
  echo "test: skipped (HANDOFF_SKIP=$HANDOFF_SKIP): ${line:-nothing}"
  rm -f "$HANDOFF_SKIP_LOG"
}
trap said EXIT

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # UCX for the data-plane tests; nftables (and iproute2) for the partition tests, which cut
  # one plane between network namespaces.
  want=()
  ldconfig -p | grep -q libucp.so || want+=(libucx0 ucx-utils)
  command -v nft >/dev/null 2>&1 || want+=(nftables)
  command -v ip >/dev/null 2>&1 || want+=(iproute2)
  if [ ${#want[@]} -gt 0 ]; then
    apt-get update -qq && apt-get install -y -qq "${want[@]}" >/dev/null \
      || echo "test: could not install ${want[*]}; the tests that need them fail unless HANDOFF_SKIP names them"
  fi
  # etcd (Debian's etcd-server) for discovery on etcd: the tests start their own members.
  if ! command -v etcd >/dev/null 2>&1; then
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends etcd-server >/dev/null; } \
      || echo "test: could not install etcd-server; the etcd tests fail unless HANDOFF_SKIP=etcd"
  fi
  # promtool (in Debian's prometheus) checks the metrics endpoints' exposition.
  if ! command -v promtool >/dev/null 2>&1; then
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
      || echo "test: could not install prometheus; the metrics test fails unless HANDOFF_SKIP=promtool"
  fi
fi
# Without root or apt, UCX 1.22 from PyPI's libucx-cu12 wheel, into a cache outside the repo.
if [ -z "${HANDOFF_UCX_LIB:-}" ] && ! ldconfig -p | grep -q libucp.so; then
  ucx_cache="${XDG_CACHE_HOME:-$HOME/.cache}/handoff/ucx-1.22.0"
  if scripts/fetch-ucx.sh "$ucx_cache" >/dev/null; then
    export HANDOFF_UCX_LIB="$ucx_cache/libucx/lib"
    echo "test: UCX from the libucx-cu12 wheel: HANDOFF_UCX_LIB=$HANDOFF_UCX_LIB"
  else
    echo "test: could not fetch UCX; the UCX tests fail unless HANDOFF_SKIP=ucx"
  fi
fi
# libzmq through pyzmq, for the ZeroMQ interop test.
python3 -c "import zmq" 2>/dev/null || python3 -m pip install -q pyzmq >/dev/null 2>&1 \
  || echo "test: could not install pyzmq; the libzmq interop test fails unless HANDOFF_SKIP=pyzmq"

echo "== cargo test --workspace"
cargo test --workspace

echo "== python/run-tests.sh"
python/run-tests.sh

if [[ $skip == *,vllm,* ]]; then
  skipped+=("vllm: real vLLM through the connector")
else
  echo "== scripts/vllm-e2e.sh"
  scripts/vllm-e2e.sh
fi

if [[ $skip == *,sglang,* ]]; then
  skipped+=("sglang: real SGLang through the backend")
else
  echo "== scripts/sglang-e2e.sh"
  scripts/sglang-e2e.sh
fi

echo "test: every suite passed"
