#!/usr/bin/env bash
# The GPU checks of issue 5, in two halves:
#
#   scripts/gpu-check.sh prepare   here (with cargo and the network): builds the release
#                                  binary and the GPU test binaries, and unpacks UCX 1.22
#                                  with CUDA (the libucx-cu12 wheel) into .carry/
#   scripts/gpu-check.sh run       on the GPU machine (no cargo, no network), from the
#                                  repository root with .carry/ carried: runs the GPU tests
#                                  and `handoff bench --memory cuda`; logs go to $OUT (or
#                                  .carry/out) as well as to the terminal.
#
# .carry/ is ignored by git. Everything in it is stripped to stay well under the device
# tool's 64 MiB working-tree limit.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
carry="$root/.carry"

prepare() {
    cd "$root"
    rm -rf "$carry/bin" "$carry/ucx"
    mkdir -p "$carry/bin" "$carry/ucx" "$carry/wheels"
    cargo build --release --bin handoff
    cp target/release/handoff "$carry/bin/handoff"
    # The test binaries that exercise a GPU: the gpu crate's, the CUDA data plane's, and
    # the bench CLI's (two processes on one GPU).
    local built
    built=$(cargo test --release --no-run --message-format=json \
        -p handoff-gpu --test cuda \
        -p handoff-transport --test data_ucx_cuda \
        -p handoff-cli --test bench_cli --test multiprocess 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["target"]["name"], m["executable"])
')
    while read -r name exe; do
        cp "$exe" "$carry/bin/test-$name"
    done <<<"$built"
    "$root/scripts/fetch-ucx.sh" "$carry/ucx" "$carry/wheels"
    strip --strip-debug "$carry"/bin/* 2>/dev/null || true
    chmod +x "$carry"/bin/*
    du -sh "$carry/bin" "$carry/ucx"
    echo "ready: carry .carry/bin and .carry/ucx, then run: bash scripts/gpu-check.sh run"
}

run() {
    cd "$root"
    local out="${OUT:-$carry/out}"
    mkdir -p "$out"
    export HANDOFF_UCX_LIB="$carry/ucx/libucx/lib"
    export HANDOFF_BIN="$carry/bin/handoff"
    export LD_LIBRARY_PATH="$carry/ucx/libucx_cu12.libs:${LD_LIBRARY_PATH:-}"
    export RUST_BACKTRACE=1
    # A GPU test that cannot run here fails (gpu is not in the list); what the GPU machine
    # may lack besides (nftables, pyzmq, a LAN) is checked in CI.
    export HANDOFF_SKIP="netns,pyzmq,lan"
    checks "$out" 2>&1 | tee "$out/gpu-check.log"
    return "${PIPESTATUS[0]}"
}

checks() {
    # Every check runs, whatever an earlier one did; the status says whether all passed.
    set +e
    local out=$1 status=0 logs
    logs=$(mktemp -d)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    for t in "$carry"/bin/test-*; do
        local name args=(--test-threads=1 --nocapture)
        name=$(basename "$t")
        # The multiprocess suite's GPU tests only: the rest need nftables and engines
        # that the GPU machine does not have, and run in CI.
        [[ $name == test-multiprocess ]] && args+=(gpu)
        echo "== $name"
        timeout "${GPU_TEST_TIMEOUT:-240}" "$t" "${args[@]}" 2>&1 | tee "$logs/$name.log"
        [[ ${PIPESTATUS[0]} == 0 ]] || status=1
        # On the GPU machine a skip is a failure: the point of this run is the GPU path.
        if grep -q "SKIP (gpu)" "$logs/$name.log"; then
            echo "!! $name skipped its GPU tests on a GPU machine"
            status=1
        fi
    done
    echo "== handoff bench --memory cuda"
    timeout 200 "$HANDOFF_BIN" bench --memory cuda --no-perftest --json "$out/bench-cuda.json" ||
        status=1
    # The same, with same-host copies off: UCX's own cuda_ipc, the reference the CUDA IPC
    # lane is compared with.
    echo "== HANDOFF_SAME_HOST_COPIES=0 handoff bench --memory cuda"
    HANDOFF_SAME_HOST_COPIES=0 timeout 200 "$HANDOFF_BIN" bench --memory cuda --no-perftest \
        --json "$out/bench-cuda-ucx.json" || status=1
    echo "== handoff bench --memory cuda --peer-memory host"
    timeout 120 "$HANDOFF_BIN" bench --memory cuda --peer-memory host --quick \
        --json "$out/bench-cuda-host.json" || status=1
    echo "== gpu-check status $status"
    return "$status"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *)
        echo "usage: $0 prepare|run" >&2
        exit 2
        ;;
esac
