"""A worker in its own process, driven by the tests through stdin and stdout (JSON lines).

    python peer.py '{"role": "prefill", "engine": "P", "bootstrap": "tcp://...", ...}'

prints ``{"event": "ready", ...}`` once registered, then runs one command per stdin line:
``{"op": "send", "id", "blocks", "seed"}`` (prefill: fill the blocks with the pattern of
``seed`` and hand them over), ``{"op": "open", "id"}`` (prefill: open without sending),
``{"op": "recv", "id", "prefill", "blocks"}`` (decode), ``{"op": "wait", "id",
"timeout_s", "seed"}`` (prints ``end`` with the state and, on decode with a seed, whether
every byte is the pattern), ``{"op": "poll", "id"}``, ``{"op": "exit"}``.
"""

from __future__ import annotations

import json
import sys
import time

import handoff
import numpy as np


def pattern(seed: int, k: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng([seed, k]).integers(0, 256, nbytes, dtype=np.uint8)


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    kv = np.zeros((cfg.get("num_blocks", 64), cfg.get("block_bytes", 4096)), dtype=np.uint8)
    rt = handoff.Runtime(
        cfg["role"],
        cfg["engine"],
        cfg["bootstrap"],
        [kv],
        transport=cfg.get("transport", "tcp"),
        mode=cfg.get("mode", "push"),
        heartbeat_ms=cfg.get("heartbeat_ms", 200),
        heartbeats_missed=cfg.get("heartbeats_missed", 3),
        timeouts=cfg.get("timeouts"),
        tcp_busy_poll_us=cfg.get("tcp_busy_poll_us"),
    )
    emit(event="ready", transport=rt.transport, control=rt.control_address)
    handles: dict[str, object] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "send":
                for k, b in enumerate(cmd["blocks"]):
                    kv[b] = pattern(cmd["seed"], k, kv.shape[1])
                h = handles.get(cmd["id"]) or rt.sender(cmd["id"])
                handles[cmd["id"]] = h
                h.send(cmd["blocks"])
                emit(event="ok", op=op)
            elif op == "open":
                handles[cmd["id"]] = rt.sender(cmd["id"])
                emit(event="ok", op=op)
            elif op == "recv":
                h = rt.receiver(cmd["id"], cmd["prefill"], blocks=cmd["blocks"])
                handles[cmd["id"]] = h
                emit(event="ok", op=op)
            elif op == "poll":
                emit(event="state", state=handles[cmd["id"]].poll())
            elif op == "wait":
                h = handles[cmd["id"]]
                started = time.monotonic()
                try:
                    state, reason = h.wait(cmd["timeout_s"]), None
                except handoff.HandoffError as e:
                    state, reason = h.poll(), e.reason
                verified = None
                if cmd.get("seed") is not None and state == "Done":
                    verified = all(
                        np.array_equal(kv[b], pattern(cmd["seed"], k, kv.shape[1]))
                        for k, b in enumerate(cmd["blocks"])
                    )
                ms = (time.monotonic() - started) * 1e3
                emit(event="end", state=state, reason=reason, verified=verified, ms=ms)
            elif op == "exit":
                break
        except handoff.HandoffError as e:
            emit(event="error", op=op, reason=e.reason, detail=e.detail)
    rt.shutdown()
    emit(event="bye")


if __name__ == "__main__":
    main()
