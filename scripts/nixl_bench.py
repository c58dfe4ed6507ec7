"""NIXL's throughput between two processes on this host, measured as `handoff bench` measures
ours: the reference for the data plane's speed (the same block sizes and region, blocks to a
seeded random permutation of positions, a warm-up pass and then timed passes over the whole
region, each point's rate the median pass's with the slowest and fastest pass's, and every
point checked by comparing the destination blocks with the source).

    ~/.cache/handoff/vllm/venv/bin/python scripts/nixl_bench.py [--quick] [--json FILE]

Needs the `nixl` package (scripts/vllm-e2e.sh installs it in its venv, ~/.cache/handoff/vllm).
The initiator (this process) posts one NIXL transfer per pass, a descriptor per block, and
waits for it by polling, which drives progress (`--progress-thread` runs NIXL's own thread
instead, as vLLM's NixlConnector does); the target is a child process that only holds its
registered memory, its progress thread on. Host memory on both sides
(numpy arrays, registered with NIXL's UCX backend). Exit status: 0 when every point was
verified, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

BLOCK_SIZES = [16 << 10, 128 << 10, 1 << 20, 4 << 20]
#: A pass that does not finish in this long fails the point (a wedged transfer, not a slow one).
PASS_TIMEOUT_S = 60.0


def permutation(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, np.uint8)


def digest(region: np.ndarray, blocks, block: int) -> str:
    """A hash of `blocks` of `region`, in that order."""
    h = hashlib.blake2b(digest_size=16)
    for b in blocks:
        h.update(region[int(b) * block : (int(b) + 1) * block].data)
    return h.hexdigest()


def agent(name: str, progress_thread: bool):
    from nixl._api import nixl_agent, nixl_agent_config

    conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    return nixl_agent(name, conf)


#: Starts the child's answers on its stdout (NIXL and UCX may print there too).
MARK = "@@ "


def say(msg: dict) -> None:
    print(MARK + json.dumps(msg), flush=True)


def target(region_bytes: int) -> None:
    """The child: registers its region and answers the initiator's lines (JSON) on stdin.
    NIXL's progress thread serves the peer's connection while this thread waits on stdin."""
    me = agent("target", True)
    region = np.zeros(region_bytes, dtype=np.uint8)
    me.register_memory([(region.ctypes.data, region_bytes, 0, "")], "DRAM")
    send = {"meta": me.get_agent_metadata().hex(), "base": region.ctypes.data}
    say(send)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "fill":
            region[:] = pattern(cmd["seed"], region_bytes)
            say({"ok": True})
        elif cmd["op"] == "digest":
            say({"digest": digest(region, cmd["blocks"], cmd["block"])})
        elif cmd["op"] == "exit":
            return


def answer(child: subprocess.Popen) -> dict:
    """The child's next answer, past whatever else it printed."""
    while True:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the target process ended (status {child.poll()})")
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])


def ask(child: subprocess.Popen, cmd: dict) -> dict:
    child.stdin.write(json.dumps(cmd) + "\n")
    child.stdin.flush()
    return answer(child)


def one_pass(me, handle) -> float:
    started = time.perf_counter()
    state = me.transfer(handle)
    deadline = started + PASS_TIMEOUT_S
    while state == "PROC":
        if time.perf_counter() > deadline:
            raise RuntimeError(f"a pass took over {PASS_TIMEOUT_S} s")
        state = me.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer state {state}")
    return time.perf_counter() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB regions, 256 MiB per point")
    ap.add_argument("--region-mib", type=int, default=256, help="region size on each side")
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes per point, at least")
    ap.add_argument("--repeat", type=int, default=5, help="timed passes per point, at least")
    ap.add_argument("--seed", type=int, default=1, help="seed of patterns and permutations")
    ap.add_argument("--block-kib", default="", help="block sizes, KiB, comma-separated")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument(
        "--progress-thread",
        action="store_true",
        help="run NIXL's progress thread (as vLLM does) instead of the initiator's polling"
        " driving progress",
    )
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    region_bytes = (64 if args.quick else args.region_mib) << 20
    if args.target:
        target(region_bytes)
        return 0
    total = (256 if args.quick else args.total_mib) << 20
    passes = max(-(-total // region_bytes), args.repeat, 1)
    sizes = [int(k) << 10 for k in args.block_kib.split(",") if k] or BLOCK_SIZES
    child = subprocess.Popen(
        [sys.executable, __file__, "--target", "--region-mib", str(region_bytes >> 20)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    points, ok = [], True
    try:
        hello = answer(child)
        me = agent("initiator", args.progress_thread)
        local = np.zeros(region_bytes, dtype=np.uint8)
        me.register_memory([(local.ctypes.data, region_bytes, 0, "")], "DRAM")
        remote = me.add_remote_agent(bytes.fromhex(hello["meta"]))
        print(
            f"nixl bench: {region_bytes >> 20} MiB regions, {passes} passes over the region"
            " per point after a warm-up: the median pass's rate, and the slowest and fastest"
            " pass's; blocks to a seeded random permutation\n"
        )
        print(f"{'transport':<10} {'op':<6} {'block':>8} {'GB/s':>7} {'min-max':>13}  checksum")
        for block in sizes:
            n = region_bytes // block
            perm = permutation(args.seed ^ block, n)
            base = local.ctypes.data
            mine = me.get_xfer_descs([(base + i * block, block, 0) for i in range(n)], "DRAM")
            theirs = me.get_xfer_descs(
                [(hello["base"] + int(p) * block, block, 0) for p in perm], "DRAM"
            )
            for op in ("WRITE", "READ"):
                if op == "WRITE":
                    local[:] = pattern(args.seed + block, region_bytes)
                else:
                    ask(child, {"op": "fill", "seed": args.seed + block + 1})
                handle = me.initialize_xfer(op, mine, theirs, remote)
                one_pass(me, handle)  # warm-up
                secs = sorted(one_pass(me, handle) for _ in range(passes))
                me.release_xfer_handle(handle)
                there = ask(child, {"op": "digest", "blocks": perm.tolist(), "block": block})
                verified = there["digest"] == digest(local, range(n), block)
                ok &= verified
                rate = region_bytes / statistics.median(secs) / 1e9
                lo, hi = region_bytes / secs[-1] / 1e9, region_bytes / secs[0] / 1e9
                size = f"{block >> 20} MiB" if block >= 1 << 20 else f"{block >> 10} KiB"
                print(
                    f"{'nixl':<10} {op.lower():<6} {size:>8} {rate:>7.2f} {lo:>6.2f}-{hi:<6.2f}"
                    f"  {'ok' if verified else 'MISMATCH'}",
                    flush=True,
                )
                points.append({
                    "transport": "nixl", "op": op.lower(), "block_bytes": block,
                    "gbps": rate, "gbps_min": lo, "gbps_max": hi, "pass_secs": secs,
                    "verified": verified,
                })  # fmt: skip
        ask_exit = json.dumps({"op": "exit"}) + "\n"
        child.stdin.write(ask_exit)
        child.stdin.flush()
    finally:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"region_bytes": region_bytes, "passes": passes, "points": points}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not through the interpreter's teardown: NIXL 1.5.1's agent crashes there (SIGSEGV)
    # after every result is out.
    os._exit(code)
