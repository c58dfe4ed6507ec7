#!/usr/bin/env bash
# Sets up what the tests need and runs every test: the Rust workspace, the Python package
# (python/run-tests.sh: a cached venv, `pip install ./python`, ruff, pytest) and real vLLM
# prefill/decode through the connector (scripts/vllm-e2e.sh) and real SGLang prefill/decode
# through the backend (scripts/sglang-e2e.sh), each in a cached venv outside the repo.
# Idempotent; fast on a warm machine. .ci/run calls it.
#
#   scripts/test.sh
#
# HANDOFF_SKIP=vllm,sglang (comma-separated) leaves out the vLLM or SGLang end-to-end runs,
# which need ~5 and ~7 GB and a few minutes each the first time; what was left out is said at
# the end, never silently.
set -euo pipefail
cd "$(dirname "$0")/.."
skip=",${HANDOFF_SKIP:-},"
skipped=()

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # UCX for the data-plane tests; nftables (and iproute2) for the partition tests, which cut
  # one plane between network namespaces.
  want=()
  ldconfig -p | grep -q libucp.so || want+=(libucx0 ucx-utils)
  command -v nft >/dev/null 2>&1 || want+=(nftables)
  command -v ip >/dev/null 2>&1 || want+=(iproute2)
  if [ ${#want[@]} -gt 0 ]; then
    apt-get update -qq && apt-get install -y -qq "${want[@]}" >/dev/null \
      || echo "test: could not install ${want[*]}; the tests that need them will say they skip"
  fi
fi
# libzmq through pyzmq, for the ZeroMQ interop test.
python3 -c "import zmq" 2>/dev/null || python3 -m pip install -q pyzmq >/dev/null 2>&1 \
  || echo "test: could not install pyzmq; the libzmq interop test will say it skips"

echo "== cargo test --workspace"
cargo test --workspace

echo "== python/run-tests.sh"
python/run-tests.sh

if [[ $skip == *,vllm,* ]]; then
  skipped+=("vllm (HANDOFF_SKIP=vllm): real vLLM through the connector")
else
  echo "== scripts/vllm-e2e.sh"
  scripts/vllm-e2e.sh
fi

if [[ $skip == *,sglang,* ]]; then
  skipped+=("sglang (HANDOFF_SKIP=sglang): real SGLang through the backend")
else
  echo "== scripts/sglang-e2e.sh"
  scripts/sglang-e2e.sh
fi

if [ ${#skipped[@]} -gt 0 ]; then
  echo "test: passed; skipped on request: ${skipped[*]}"
else
  echo "test: every suite passed"
fi
