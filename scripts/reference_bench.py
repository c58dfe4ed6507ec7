"""Another transfer engine's throughput between two processes on this host, measured as
`handoff bench` measures ours: the references for the data plane's speed (the same block
sizes and region, blocks to a seeded random permutation of positions, a warm-up pass and
then timed passes over the whole region, each point's rate the median pass's with the
slowest and fastest pass's, and every point checked by comparing the destination blocks
with the source). Host memory on both sides (numpy arrays, registered with the engine).

    ~/.cache/handoff/vllm/venv/bin/python scripts/reference_bench.py --engine nixl
    ~/.cache/handoff/sglang/venv/bin/python scripts/reference_bench.py --engine mooncake

- `nixl`: NVIDIA NIXL over its UCX backend (scripts/vllm-e2e.sh installs it in its venv).
  One transfer per pass, a descriptor per block, waited for by polling, which drives
  progress (`--progress-thread` runs NIXL's own thread instead, as vLLM's NixlConnector
  does).
- `mooncake`: Mooncake Transfer Engine over TCP, as SGLang's mooncake backend runs it on
  this machine (scripts/sglang-e2e.sh installs it in its venv): synchronous batches of
  `MOONCAKE_BATCH_MAX` entries, one per block.

Then one-block latency: 16 KiB writes timed one call each (p50/p99), as `handoff bench`'s
latency row; NIXL makes each from prepared descriptor lists, Mooncake with
`transfer_sync_write`. The Python call is in both numbers (a few µs).

The target is a child process that only holds its registered memory (NIXL: its progress
thread on). Exit status: 0 when every point was verified, 1 otherwise.
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
#: Block of the one-block latency row (`handoff bench`'s LATENCY_BLOCK_BYTES).
LATENCY_BLOCK = 16 << 10
#: Entries per Mooncake batch: its TCP lanes refuse a batch that overflows their queue
#: ("TCP lane queue-full rejection": 4096 entries did; 1024 ran faster here than 128).
MOONCAKE_BATCH_MAX = 1024
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


class Nixl:
    """NIXL, one agent per process."""

    def __init__(self, name: str, progress_thread: bool):
        from nixl._api import nixl_agent, nixl_agent_config

        conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.me = nixl_agent(name, conf)
        self.remote = None

    def register(self, region: np.ndarray) -> None:
        self.me.register_memory([(region.ctypes.data, region.nbytes, 0, "")], "DRAM")

    def address(self) -> str:
        return self.me.get_agent_metadata().hex()

    def connect(self, address: str) -> None:
        self.remote = self.me.add_remote_agent(bytes.fromhex(address))

    def prepare(self, op: str, local: list[int], remote: list[int], block: int):
        mine = self.me.get_xfer_descs([(a, block, 0) for a in local], "DRAM")
        theirs = self.me.get_xfer_descs([(a, block, 0) for a in remote], "DRAM")
        handle = self.me.initialize_xfer(op.upper(), mine, theirs, self.remote)

        def one_pass() -> float:
            started = time.perf_counter()
            state = self.me.transfer(handle)
            deadline = started + PASS_TIMEOUT_S
            while state == "PROC":
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"a pass took over {PASS_TIMEOUT_S} s")
                state = self.me.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")
            return time.perf_counter() - started

        return one_pass, lambda: self.me.release_xfer_handle(handle)

    def one_block_writes(self, local: list[int], remote: list[int], block: int):
        """One block per transfer, as an engine posts a request's: descriptor lists prepared
        once, a transfer made from them per call, polled to done, released."""
        mine = self.me.prep_xfer_dlist("NIXL_INIT_AGENT", [(a, block, 0) for a in local], "DRAM")
        theirs = self.me.prep_xfer_dlist(self.remote, [(a, block, 0) for a in remote], "DRAM")

        def one(i: int) -> None:
            handle = self.me.make_prepped_xfer("WRITE", mine, [i], theirs, [i])
            state = self.me.transfer(handle)
            deadline = time.perf_counter() + PASS_TIMEOUT_S
            while state == "PROC":
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"a write took over {PASS_TIMEOUT_S} s")
                state = self.me.check_xfer_state(handle)
            self.me.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")

        def release() -> None:
            self.me.release_dlist_handle(mine)
            self.me.release_dlist_handle(theirs)

        return one, release


class Mooncake:
    """Mooncake Transfer Engine over TCP, peers meeting without a metadata server."""

    def __init__(self, name: str, progress_thread: bool):
        from mooncake.engine import TransferEngine

        self.me = TransferEngine()
        if self.me.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake TransferEngine.initialize failed")
        self.session = None

    def register(self, region: np.ndarray) -> None:
        if self.me.register_memory(region.ctypes.data, region.nbytes) != 0:
            raise RuntimeError("Mooncake register_memory failed")

    def address(self) -> str:
        return f"127.0.0.1:{self.me.get_rpc_port()}"

    def connect(self, address: str) -> None:
        self.session = address

    def prepare(self, op: str, local: list[int], remote: list[int], block: int):
        call = (
            self.me.batch_transfer_sync_write if op == "write" else self.me.batch_transfer_sync_read
        )
        step = MOONCAKE_BATCH_MAX

        def one_pass() -> float:
            started = time.perf_counter()
            for i in range(0, len(local), step):
                mine, theirs = local[i : i + step], remote[i : i + step]
                if call(self.session, mine, theirs, [block] * len(mine)) != 0:
                    raise RuntimeError(f"batch transfer ({op}) failed")
            return time.perf_counter() - started

        return one_pass, lambda: None

    def one_block_writes(self, local: list[int], remote: list[int], block: int):
        """One block per synchronous transfer."""

        def one(i: int) -> None:
            if self.me.transfer_sync_write(self.session, local[i], remote[i], block) != 0:
                raise RuntimeError("transfer_sync_write failed")

        return one, lambda: None


ENGINES = {"nixl": Nixl, "mooncake": Mooncake}


#: Starts the child's answers on its stdout (NIXL and UCX may print there too).
MARK = "@@ "


def say(msg: dict) -> None:
    print(MARK + json.dumps(msg), flush=True)


def target(engine: str, region_bytes: int) -> None:
    """The child: registers its region and answers the initiator's lines (JSON) on stdin.
    NIXL's progress thread serves the peer's connection while this thread waits on stdin."""
    me = ENGINES[engine]("target", True)
    region = np.zeros(region_bytes, dtype=np.uint8)
    me.register(region)
    say({"address": me.address(), "base": region.ctypes.data})
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


def one_block_latency(me, child, hello, local, region_bytes: int, args) -> dict:
    """One-block writes timed one by one, as `handoff bench`'s latency row: blocks of
    `LATENCY_BLOCK` in order to a seeded permutation of the peer's, after a pass over the
    region that warms connections and mappings and a tenth as many untimed writes; the
    destination is checked at the end."""
    block = LATENCY_BLOCK
    n = region_bytes // block
    iters = 200 if args.quick else args.latency_iters
    perm = permutation(args.seed ^ 0x1A7E, n)
    mine = [local.ctypes.data + i * block for i in range(n)]
    theirs = [hello["base"] + int(p) * block for p in perm]
    local[:] = pattern(args.seed + 7, region_bytes)
    one, release = me.one_block_writes(mine, theirs, block)
    for i in range(n):
        one(i)
    warmup = max(iters // 10, 10)
    samples = []
    for i in range(warmup + iters):
        started = time.perf_counter()
        one(i % n)
        if i >= warmup:
            samples.append((time.perf_counter() - started) * 1e6)
    release()
    there = ask(child, {"op": "digest", "blocks": perm.tolist(), "block": block})
    verified = there["digest"] == digest(local, range(n), block)
    samples.sort()
    p50 = samples[len(samples) // 2]
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    print(f"\n{'latency':<10} {'op':<6} {'samples':>8} {'p50 µs':>8} {'p99 µs':>8}  checksum")
    print(
        f"{args.engine:<10} {'write':<6} {iters:>8} {p50:>8.1f} {p99:>8.1f}"
        f"  {'ok' if verified else 'MISMATCH'}  (one {block >> 10} KiB block per call)",
        flush=True,
    )
    return {
        "transport": args.engine, "op": "write", "block_bytes": block, "samples": iters,
        "p50_us": p50, "p99_us": p99, "verified": verified,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=sorted(ENGINES), required=True, help="what to measure")
    ap.add_argument("--quick", action="store_true", help="64 MiB regions, 256 MiB per point")
    ap.add_argument("--region-mib", type=int, default=256, help="region size on each side")
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes per point, at least")
    ap.add_argument("--repeat", type=int, default=5, help="timed passes per point, at least")
    ap.add_argument("--seed", type=int, default=1, help="seed of patterns and permutations")
    ap.add_argument("--block-kib", default="", help="block sizes, KiB, comma-separated")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument(
        "--latency-iters", type=int, default=1000, help="one-block writes timed (200 with --quick)"
    )
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
        target(args.engine, region_bytes)
        return 0
    total = (256 if args.quick else args.total_mib) << 20
    passes = max(-(-total // region_bytes), args.repeat, 1)
    sizes = [int(k) << 10 for k in args.block_kib.split(",") if k] or BLOCK_SIZES
    child = subprocess.Popen(
        [sys.executable, __file__, "--target", "--engine", args.engine,
         "--region-mib", str(region_bytes >> 20)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    points, ok, latency = [], True, None
    try:
        hello = answer(child)
        me = ENGINES[args.engine]("initiator", args.progress_thread)
        local = np.zeros(region_bytes, dtype=np.uint8)
        me.register(local)
        me.connect(hello["address"])
        print(
            f"{args.engine} bench: {region_bytes >> 20} MiB regions, {passes} passes over the"
            " region per point after a warm-up: the median pass's rate, and the slowest and"
            " fastest pass's; blocks to a seeded random permutation\n"
        )
        print(f"{'transport':<10} {'op':<6} {'block':>8} {'GB/s':>7} {'min-max':>13}  checksum")
        for block in sizes:
            n = region_bytes // block
            perm = permutation(args.seed ^ block, n)
            mine = [local.ctypes.data + i * block for i in range(n)]
            theirs = [hello["base"] + int(p) * block for p in perm]
            for op in ("write", "read"):
                if op == "write":
                    local[:] = pattern(args.seed + block, region_bytes)
                else:
                    ask(child, {"op": "fill", "seed": args.seed + block + 1})
                one_pass, release = me.prepare(op, mine, theirs, block)
                one_pass()  # warm-up
                secs = sorted(one_pass() for _ in range(passes))
                release()
                there = ask(child, {"op": "digest", "blocks": perm.tolist(), "block": block})
                verified = there["digest"] == digest(local, range(n), block)
                ok &= verified
                rate = region_bytes / statistics.median(secs) / 1e9
                lo, hi = region_bytes / secs[-1] / 1e9, region_bytes / secs[0] / 1e9
                size = f"{block >> 20} MiB" if block >= 1 << 20 else f"{block >> 10} KiB"
                print(
                    f"{args.engine:<10} {op:<6} {size:>8} {rate:>7.2f} {lo:>6.2f}-{hi:<6.2f}"
                    f"  {'ok' if verified else 'MISMATCH'}",
                    flush=True,
                )
                points.append({
                    "transport": args.engine, "op": op, "block_bytes": block,
                    "gbps": rate, "gbps_min": lo, "gbps_max": hi, "pass_secs": secs,
                    "verified": verified,
                })  # fmt: skip
        latency = one_block_latency(me, child, hello, local, region_bytes, args)
        ok &= latency["verified"]
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
            json.dump(
                {
                    "region_bytes": region_bytes,
                    "passes": passes,
                    "points": points,
                    "latency": [latency] if latency else [],
                },
                f,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not through the interpreter's teardown: NIXL 1.5.1's agent crashes there (SIGSEGV)
    # after every result is out.
    os._exit(code)
