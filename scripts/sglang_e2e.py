"""Real SGLang P/D through handoff's backend and through mooncake's TCP backend, side by side.

Run by scripts/sglang-e2e.sh inside its venv (standard library only here; the SGLang servers
are separate processes). Prints one line per check (`PASS`/`FAIL`), then a table of timings
for both backends, and exits 0 only when every check passed.

A tiny Llama (4 layers, hidden 256, 2 KV heads, vocab 1024) with dummy weights gives every
instance the same seeded weights, so decode's greedy tokens after a transfer must equal what
a single, non-disaggregated server computes for the same prompt. Decode computes no prompt
token itself: its first token comes from prefill, and every later one reads the moved KV.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import e2e_common as common
from e2e_common import SIZES, TINY_CONFIG, ServerProcess, check, free_port, prompt, until

DECODE_TOKENS = 8
#: The first round of each prompt size is checked, not timed (it warms the pair up).
ROUNDS_UNTIMED = 1
#: The sizes' servers sleep while idle, so that one backend's idle pair does not spin a core
#: while the other's request runs.
SIZES_EXTRA = ["--sleep-on-idle"]
#: Seconds an SGLang server may take to come up on a 2-core machine.
STARTUP_S_MAX = 300
#: Seconds within which decode must answer a request whose prefill died.
PREFILL_LOSS_ANSWER_S_MAX = 10.0
#: Seconds within which prefill must free a request's pages after decode died.
DECODE_LOSS_FREE_S_MAX = 10.0
#: How late the slow prefill hands its pages over (so a peer can die meanwhile).
SEND_DELAY_MS = 5000
#: SGLang's FAKE_BOOTSTRAP_HOST: a request with it runs through decode without a prefill.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
#: Seed 003 (PD + pipeline parallelism + a saturated decode): prefill runs in two pipeline
#: stages; decode's KV pool (--max-total-tokens) holds about two of these requests at once.
SEED3_DECODE_POOL = 1024
SEED3_PROMPT = 300
SEED3_NEW_TOKENS = 24
SEED3_REQUESTS = 6
#: Seconds within which a queued request must be answered (it waits for decode's pages).
SEED3_ANSWER_S_MAX = 120.0
#: The bootstrap deadline of the deadline case, and the blocker that outlasts it: a request
#: that needs no prefill and holds most of decode's pool (of SEED3_BLOCKED_POOL tokens) for
#: thousands of decode steps, until it is aborted.
SEED3_BOOTSTRAP_S = 6
SEED3_BLOCKED_POOL = 4096
SEED3_BLOCKER_PROMPT = 200
SEED3_BLOCKER_TOKENS = 3800


class Server(ServerProcess):
    """One SGLang server process (`python -m sglang.launch_server`)."""

    def __init__(self, args, name: str, port: int, cpu, extra: list[str], env: dict):
        full_env = dict(os.environ)
        full_env.update(
            SGLANG_USE_CPU_ENGINE="1",
            SGLANG_HOST_IP="127.0.0.1",
            SGLANG_CPU_OMP_THREADS_BIND=str(cpu),
            # Test rig: the early send of a cached prefix records a CUDA event.
            SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX="0",
            PYTHONPATH=str(Path(args.dir) / "shims"),
            PYTHONUNBUFFERED="1",
        )
        full_env.update(env)
        # The torch.distributed store's port too, from the ports this run hands out: left to
        # SGLang, each instance draws it at random from 22000-29999 as it starts and binds
        # it a minute later, so instances starting together can draw one port (a CI run's
        # decode died so: EADDRINUSE on its store's port).
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(Path(args.dir) / "tiny"), "--load-format", "dummy",
            "--skip-tokenizer-init", "--device", "cpu", "--host", "127.0.0.1",
            "--port", str(port), "--nccl-port", str(free_port()),
            "--max-total-tokens", "8192", "--max-running-requests", "4",
            "--disable-cuda-graph", "--enable-metrics", *extra,
        ]  # fmt: skip
        super().__init__(name, port, Path(args.dir) / "logs" / f"{name}.log", cmd, full_env)

    def tail(self, n: int = 25) -> str:
        lines = self.text().splitlines()
        return "\n".join(line[:300] for line in lines if "server_args=" not in line)[-4000:]


def wait_up(servers: list[Server]) -> None:
    common.wait_up(servers, STARTUP_S_MAX)


def body(args, ids: list[int], room: int, tokens: int = DECODE_TOKENS) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": args.bootstrap_port,
        "bootstrap_room": room,
    }


def post(port: int, payload: dict, timeout: float = 120) -> tuple[float, dict | None, str]:
    """POST /generate: (seconds, json or None, error text)."""
    return common.post_json(port, "/generate", payload, timeout)


def stream(port: int, payload: dict, timeout: float = 120):
    """Streamed /generate: (seconds to the first token, total seconds, token ids, error)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=json.dumps(dict(payload, stream=True)).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = time.perf_counter()
    first = None
    tokens: list[int] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                ids = chunk.get("output_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - t
                # Streamed chunks carry the new ids (or all so far, by version).
                tokens = (
                    ids
                    if len(ids) >= len(tokens) and ids[: len(tokens)] == tokens
                    else (tokens + ids)
                )
    except urllib.error.HTTPError as e:
        return (
            None,
            time.perf_counter() - t,
            tokens,
            f"HTTP {e.code}: {e.read()[:300]!r}",
        )
    except (urllib.error.URLError, OSError) as e:
        return None, time.perf_counter() - t, tokens, str(e)
    return first, time.perf_counter() - t, tokens, ""


def metric(port: int, name: str) -> float:
    """A Prometheus sample summed over its labels (0 when absent)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return 0.0
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) == name:
            with contextlib.suppress(ValueError):
                total += float(m.group(3))
    return total


def pd_round(args, ids: list[int]) -> dict:
    """One request sent to prefill and decode at once, as SGLang's router does."""
    room = random.randrange(1, 2**62)
    lat_sum = metric(args.prefill_port, "sglang:kv_transfer_latency_ms_sum")
    lat_n = metric(args.prefill_port, "sglang:kv_transfer_latency_ms_count")
    out: dict = {}

    def prefill():
        out["prefill"] = post(args.prefill_port, body(args, ids, room))

    th = threading.Thread(target=prefill)
    th.start()
    ttft, total, tokens, err = stream(args.decode_port, body(args, ids, room))
    th.join(130)
    _, rp, perr = out.get("prefill", (0, None, "no answer"))
    dn = metric(args.prefill_port, "sglang:kv_transfer_latency_ms_count") - lat_n
    ds = metric(args.prefill_port, "sglang:kv_transfer_latency_ms_sum") - lat_sum
    return {
        "ttft_s": ttft, "decode_s": total, "tokens": tokens,
        "error": err or (f"prefill: {perr}" if rp is None else ""),
        "transfer_s": ds / dn / 1000.0 if dn else None,
    }  # fmt: skip


def references(args) -> dict[tuple[int, int], list[int]]:
    """What one non-disaggregated server computes for every prompt used below."""
    args.label = "reference"
    srv = Server(args, "reference", free_port(), 0, [], {})
    try:
        wait_up([srv])
        out = {}
        for si, size in enumerate(SIZES):
            for rep in range(args.reps + 1):
                ids = prompt(size, 1000 * si + rep)
                _, r, err = post(srv.port, {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": DECODE_TOKENS, "temperature": 0},
                })  # fmt: skip
                if r is None:
                    raise RuntimeError(f"reference server: {err}")
                out[(size, rep)] = r["output_ids"]
        for i in range(SEED3_REQUESTS):
            _, r, err = post(srv.port, {
                "input_ids": seed3_prompt(i),
                "sampling_params": {"max_new_tokens": SEED3_NEW_TOKENS, "temperature": 0},
            })  # fmt: skip
            if r is None:
                raise RuntimeError(f"reference server: {err}")
            out[("seed3", i)] = r["output_ids"]
        return out
    finally:
        srv.stop()


def seed3_prompt(i: int) -> list[int]:
    return prompt(SEED3_PROMPT, 3000 + i)


def start_server(args, name: str, backend: str, mode: str, cpu, env=None, extra=()) -> Server:
    extra = [
        "--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend,
        "--disaggregation-bootstrap-port", str(args.bootstrap_port), *extra,
    ]  # fmt: skip
    if mode == "decode":
        extra += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    port = args.prefill_port if mode == "prefill" else args.decode_port
    full_env = {
        "HANDOFF_BOOTSTRAP": f"tcp://127.0.0.1:{args.bootstrap_port}",
        # Says in the servers' logs whether peers copy directly (same-host copies).
        "HANDOFF_LOG": os.environ.get("HANDOFF_E2E_LOG", "warn,handoff_net::control=info"),
    }
    if backend == "handoff":
        full_env["HANDOFF_TRANSPORT"] = args.transport
    full_env.update(env or {})
    return Server(args, name, port, cpu, extra, full_env)


def run_sizes(pairs: dict[str, argparse.Namespace], refs) -> dict[str, dict[int, list[dict]]]:
    """Every prompt size through every backend's pair, round by round: the backends take
    turns (which goes first alternates), so a slower or busier stretch of the machine falls
    on both alike."""
    rows: dict[str, dict[int, list[dict]]] = {b: {} for b in pairs}
    order = list(pairs)
    for si, size in enumerate(SIZES):
        for backend in order:
            rows[backend][size] = []
        for rep in range(ROUNDS_UNTIMED + pairs[order[0]].reps):
            turn = order if rep % 2 == 0 else order[::-1]
            for backend in turn:
                r = pd_round(pairs[backend], prompt(size, 1000 * si + rep))
                ref = refs.get((size, rep))
                ok = not r["error"] and r["tokens"] == ref
                if rep == 0 or not ok:
                    check(
                        f"{backend}: {size}-token prompt round {rep}, decode's greedy tokens "
                        "equal a single server's",
                        ok, r["error"] or f"decode {r['tokens']} reference {ref}",
                    )  # fmt: skip
                if rep >= ROUNDS_UNTIMED and not r["error"]:
                    r["round"] = rep
                    rows[backend][size].append(r)
    return rows


def pair_args(args) -> argparse.Namespace:
    """The run's options with ports of a server pair of its own."""
    pair = argparse.Namespace(**vars(args))
    pair.prefill_port, pair.decode_port = free_port(), free_port()
    pair.bootstrap_port = free_port()
    return pair


def decode_serves(args) -> tuple[bool, str]:
    """Decode answers a request that needs no prefill (SGLang's fake bootstrap host)."""
    _, r, err = post(args.decode_port, {
        "input_ids": prompt(32, 77), "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": args.bootstrap_port,
        "bootstrap_room": random.randrange(1, 2**62),
    })  # fmt: skip
    return r is not None, err or "answered"


def prefill_loss(args, d: Server) -> Server:
    """Prefill killed after its prefill, before its pages went: decode answers in seconds."""
    p = start_server(args, "handoff-slow-prefill-1", "handoff", "prefill", 0,
                     {"HANDOFF_SEND_DELAY_MS": str(SEND_DELAY_MS)})  # fmt: skip
    wait_up([p])
    ids, room = prompt(300, 4242), random.randrange(1, 2**62)
    mark = p.log_size()
    threading.Thread(
        target=post, args=(args.prefill_port, body(args, ids, room)), daemon=True
    ).start()
    out: dict = {}

    def decode():
        out["d"] = post(args.decode_port, body(args, ids, room, 4))

    th = threading.Thread(target=decode)
    th.start()
    seen = p.wait_log(rf"handoff prefill request {room}: \d+ pages computed", mark, 60)
    if seen is None:
        check(
            "handoff: prefill killed after its prefill",
            False,
            "prefill never computed it",
        )
        return p
    p.kill()
    t = time.monotonic()
    th.join(60)
    dt = time.monotonic() - t
    _, rd, err = out.get("d", (0, None, "no answer"))
    named = "peer_lost" in err or "PeerLost" in err
    check(
        "handoff: prefill killed after its prefill -> decode fails that request in seconds, "
        "by name",
        rd is None and named and dt < PREFILL_LOSS_ANSWER_S_MAX,
        f"{dt:.2f} s after the kill: {err[:200] if err else 'it answered tokens'}",
    )  # fmt: skip
    ok, detail = decode_serves(args)
    check("handoff: decode keeps serving after its prefill died", ok, detail)
    return p


def decode_loss(args, d: Server) -> Server:
    """Decode killed while prefill computes: prefill frees the pages by peer loss."""
    p = start_server(args, "handoff-slow-prefill-2", "handoff", "prefill", 0,
                     {"HANDOFF_SEND_DELAY_MS": str(SEND_DELAY_MS)})  # fmt: skip
    wait_up([p])
    ids, room = prompt(700, 5151), random.randrange(1, 2**62)
    mark = p.log_size()
    for port in (args.prefill_port, args.decode_port):
        threading.Thread(
            target=post, args=(port, body(args, ids, room, 4), 60), daemon=True
        ).start()
    seen = p.wait_log(rf"handoff prefill request {room}: \d+ pages computed", mark, 60)
    if seen is None:
        check("handoff: decode killed mid-handoff", False, "prefill never computed it")
        return p
    d.kill()
    t = time.monotonic()
    freed = p.wait_log(rf"handoff prefill request {room} failed: peer_lost", seen[1], 60)
    dt = time.monotonic() - t
    check(
        "handoff: decode killed mid-handoff -> prefill frees the pages by peer loss",
        freed is not None and dt < DECODE_LOSS_FREE_S_MAX,
        f"{dt:.2f} s after the kill: " + (freed[0].strip()[-160:] if freed else "never"),
    )  # fmt: skip
    _, r, err = post(args.prefill_port, {
        "input_ids": prompt(16, 99), "sampling_params": {"max_new_tokens": 1},
        "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": args.bootstrap_port,
        "bootstrap_room": random.randrange(1, 2**62),
    })  # fmt: skip
    check(
        "handoff: prefill keeps serving after its decode died",
        r is not None,
        err or "answered",
    )
    return p


CRASH = re.compile(r"Traceback|AssertionError|Scheduler hit an exception|SIGQUIT")


def seed3_pair(args, backend: str, tag: str, pool: int, env=None) -> tuple[Server, Server]:
    """Prefill in two pipeline stages (a core each), decode with a small KV pool."""
    p = start_server(args, f"{backend}-{tag}-prefill-pp2", backend, "prefill", "0|1", env,
                     ["--pp-size", "2"])  # fmt: skip
    d = start_server(args, f"{backend}-{tag}-decode", backend, "decode", 1, env,
                     ["--max-total-tokens", str(pool)])  # fmt: skip
    wait_up([p, d])
    return p, d


def scrape_race(block: list[str]) -> bool:
    """A traceback of SGLang's own `/metrics` handler reading a prometheus multiprocess
    file that another of its processes has only just created, still empty: that scrape
    answers 500 and the next one works. Not a crash of the server (seen once in CI, on
    2026-12-02: `struct.error` in prometheus_client's `mmap_dict.py`)."""
    return any("prometheus_client/multiprocess.py" in ln for ln in block) and any(
        "prometheus_client/mmap_dict.py" in ln for ln in block
    )


def crash_lines(text: str) -> list[str]:
    """The log's lines that say something crashed: a traceback (but not a scrape race,
    `scrape_race`), an assertion, a scheduler's exception, a SIGQUIT."""
    lines = text.splitlines()
    hits, i = [], 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("Traceback"):
            # The block: the frames (indented) and the exception's line after them.
            end = i + 1
            while end < len(lines) and lines[end][:1] in (" ", "\t"):
                end += 1
            block = lines[i : end + 1]
            if not scrape_race(block):
                hits.extend(b for b in block if CRASH.search(b))
            i = end + 1
            continue
        if CRASH.search(ln):
            hits.append(ln)
        i += 1
    return hits


def crashes(*servers: Server) -> str:
    """What went wrong in a server: dead, or a traceback or assertion in its log."""
    out = []
    for s in servers:
        if not s.alive():
            out.append(f"{s.name} died")
        hits = crash_lines(s.text())
        if hits:
            out.append(f"{s.name}: {hits[0][:160]}")
    return "; ".join(out)


def seed3_queue(args, backend: str, refs) -> dict:
    """More requests than decode's pool holds, sent at once: they queue for decode's pages
    and every one completes with the right tokens; both pipeline stages of prefill end
    each request the same way."""
    p, d = seed3_pair(args, backend, "queue", SEED3_DECODE_POOL)
    try:
        rooms = [random.randrange(1, 2**62) for _ in range(SEED3_REQUESTS)]
        out: dict[int, tuple] = {}

        def one(i: int) -> None:
            payload = body(args, seed3_prompt(i), rooms[i], SEED3_NEW_TOKENS)
            th = threading.Thread(target=post, args=(args.prefill_port, payload, 200))
            th.start()
            out[i] = post(args.decode_port, payload, SEED3_ANSWER_S_MAX + 30)
            th.join(30)

        t = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(SEED3_REQUESTS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(SEED3_ANSWER_S_MAX + 60)
        wall = time.monotonic() - t
        good = sum(
            1 for i in range(SEED3_REQUESTS)
            if out.get(i, (0, None, ""))[1] is not None
            and out[i][1]["output_ids"] == refs[("seed3", i)]
        )  # fmt: skip
        errors = [out[i][2][:120] for i in out if out[i][1] is None]
        slowest = max((out[i][0] for i in out), default=float("nan"))
        result = {"good": good, "errors": errors, "slowest_s": slowest, "wall_s": wall,
                  "crash": crashes(p, d)}  # fmt: skip
        if backend == "handoff":

            def stages_done() -> int:
                log = p.text()
                return sum(1 for r in rooms if len(re.findall(rf"request {r} done", log)) == 2)

            # Each stage logs its end when it polls the request next: wait for that.
            until(lambda: stages_done() == SEED3_REQUESTS, 30)
            agree = stages_done()
            result["both_stages_done"] = agree
            check(
                f"seed 003, {backend}: {SEED3_REQUESTS} requests at once into a decode that "
                "holds ~2 -> they queue and every one completes with a single server's tokens",
                good == SEED3_REQUESTS and slowest < SEED3_ANSWER_S_MAX,
                f"{good} right, slowest {slowest:.1f} s, errors {errors}",
            )  # fmt: skip
            check(
                f"seed 003, {backend}: both pipeline stages of prefill end every request Done",
                agree == SEED3_REQUESTS, f"{agree} of {SEED3_REQUESTS}",
            )  # fmt: skip
            check(f"seed 003, {backend}: nothing crashed or asserted", not result["crash"],
                  result["crash"] or "both servers alive, no traceback")  # fmt: skip
        return result
    finally:
        p.stop()
        d.stop()


def seed3_deadline(args, backend: str) -> dict:
    """Decode's pool held (by a request that needs no prefill) past prefill's bootstrap
    deadline: the waiting request fails on every rank, by name, in about the deadline, and
    both servers keep serving."""
    env = {"HANDOFF_BOOTSTRAP_TIMEOUT_S": str(SEED3_BOOTSTRAP_S),
           "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(SEED3_BOOTSTRAP_S)}  # fmt: skip
    p, d = seed3_pair(args, backend, "deadline", SEED3_BLOCKED_POOL, env)
    try:
        blocker_rid = f"blocker-{random.randrange(2**32)}"
        blocker = {
            "rid": blocker_rid,
            "input_ids": prompt(SEED3_BLOCKER_PROMPT, 31337),
            "sampling_params": {"max_new_tokens": SEED3_BLOCKER_TOKENS, "temperature": 0,
                                "ignore_eos": True},
            "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": args.bootstrap_port,
            "bootstrap_room": random.randrange(1, 2**62),
        }  # fmt: skip
        bt = threading.Thread(target=post, args=(args.decode_port, blocker, 600), daemon=True)
        bt.start()
        if not until(lambda: metric(args.decode_port, "sglang:num_running_reqs") > 0, 60):
            raise RuntimeError("the blocker never ran on decode")
        room = random.randrange(1, 2**62)
        payload = body(args, seed3_prompt(0), room, SEED3_NEW_TOKENS)
        out: dict = {}
        th = threading.Thread(
            target=lambda: out.__setitem__("p", post(args.prefill_port, payload, 120))
        )
        th.start()
        dt, rd, err = post(args.decode_port, payload, SEED3_BOOTSTRAP_S + 40)
        th.join(60)
        _, rp, perr = out.get("p", (0, None, "no answer"))
        # Free decode's pool, then both must serve a new request end to end.
        _abort(args.decode_port, blocker_rid)
        bt.join(60)
        ok_after = pd_round(args, seed3_prompt(1))
        result = {
            "decode": f"{dt:.1f} s: " + (err[:160] if rd is None else "answered"),
            "prefill": perr[:160] if rp is None else "answered",
            "serves_after": not ok_after["error"], "crash": crashes(p, d),
            "blocked": bt.is_alive(),
        }  # fmt: skip
        if backend == "handoff":
            log = p.text()
            reasons = re.findall(rf"handoff prefill request {room} failed: (\w+)", log)
            stages = len(reasons)
            result["stages_failed"] = reasons
            check(
                f"seed 003, {backend}: decode saturated past prefill's {SEED3_BOOTSTRAP_S} s "
                "bootstrap deadline -> decode's request fails by name within it",
                rd is None
                and ("bootstrap timeout" in err or "bootstrap_timeout" in err)
                and dt < SEED3_BOOTSTRAP_S + 10,
                result["decode"],
            )  # fmt: skip
            check(
                f"seed 003, {backend}: both pipeline stages fail it (by the deadline, or "
                "told by decode), and nothing crashed",
                stages == 2
                and set(reasons) <= {"bootstrap_timeout", "aborted_by_peer", "aborted_by_engine"}
                and not result["crash"],
                f"stages: {reasons}; {result['crash'] or 'no crash'}",
            )  # fmt: skip
            check(f"seed 003, {backend}: both serve the next request end to end",
                  result["serves_after"], ok_after["error"] or "answered")  # fmt: skip
        return result
    finally:
        p.stop()
        d.stop()


def _abort(port: int, rid: str) -> None:
    common.post_json(port, "/abort_request", {"rid": rid}, 10)


def seed3(args, refs) -> None:
    """Seed 003 on both backends, then what each did, side by side. Handoff's runs are
    checks; mooncake's are what users meet today, reported (a failure there is data)."""
    seen: dict[str, dict[str, dict | str]] = {}
    for backend in ("handoff", "mooncake_tcp"):
        if backend != "handoff" and args.skip_mooncake:
            continue
        seen[backend] = {}
        for part, run in (("queue", lambda b: seed3_queue(args, b, refs)),
                          ("deadline", lambda b: seed3_deadline(args, b))):  # fmt: skip
            try:
                seen[backend][part] = run(backend)
            except Exception as e:  # mooncake: reported below; handoff: a failed check
                if backend == "handoff":
                    raise
                seen[backend][part] = f"{type(e).__name__}: {str(e)[:300]}"
    print(
        f"\nSeed 003 (prefill --pp-size 2, decode --max-total-tokens {SEED3_DECODE_POOL}), "
        "what each backend did:"
    )
    for backend, r in seen.items():
        q, dl = r.get("queue"), r.get("deadline")
        if isinstance(q, dict):
            print(f"- {backend}, {SEED3_REQUESTS} requests at once: {q['good']} right tokens, "
                  f"slowest {q['slowest_s']:.1f} s, errors {q['errors'] or 'none'}, "
                  f"crash: {q['crash'] or 'none'}")  # fmt: skip
        else:
            print(f"- {backend}, {SEED3_REQUESTS} requests at once: did not run: {q}")
        if isinstance(dl, dict):
            print(f"- {backend}, pool held past a {SEED3_BOOTSTRAP_S} s bootstrap deadline: "
                  f"decode {dl['decode']}; prefill {dl['prefill']}; next request served: "
                  f"{dl['serves_after']}; crash: {dl['crash'] or 'none'}")  # fmt: skip
        else:
            print(f"- {backend}, pool held past the bootstrap deadline: did not run: {dl}")


def summarize(rows: dict[str, dict[int, list[dict]]], idle: dict[str, list[float]]) -> None:
    def med(xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            return "n/a"
        return f"{statistics.median(xs) * 1000:.1f} ({min(xs) * 1000:.1f}-{max(xs) * 1000:.1f})"

    def paired(pairs):
        """mooncake/handoff per round: the machine's state at that moment cancels out."""
        ratios = sorted(other / ours for ours, other in pairs if ours > 0)
        if len(ratios) < 4:
            return "n/a"
        q1, q2, q3 = statistics.quantiles(ratios, n=4)
        return f"{q2:.2f} ({q1:.2f}-{q3:.2f})"

    print("\nTimings, ms: median (min-max) over the timed requests of each size")
    print(
        "| prompt | metric | handoff | mooncake (tcp) | ratio (mooncake/handoff) "
        "| rounds handoff was faster | paired ratio: median (middle half) |"
    )
    print("|---|---|---|---|---|---|---|")
    for size in SIZES:
        h, m = (
            rows.get("handoff", {}).get(size, []),
            rows.get("mooncake", {}).get(size, []),
        )
        for key, name in (
            ("ttft_s", "decode TTFT"),
            ("transfer_s", "handoff (transfer)"),
        ):
            hv = [r[key] for r in h if r[key] is not None]
            mv = [r[key] for r in m if r[key] is not None]
            ratio = "n/a"
            if hv and mv:
                ratio = f"{statistics.median(mv) / statistics.median(hv):.2f}"
            # Paired: the two backends' requests of one round ran back to back.
            theirs = {r["round"]: r[key] for r in m if r[key] is not None}
            pairs = [(r[key], theirs[r["round"]]) for r in h if r[key] is not None
                     and r["round"] in theirs]  # fmt: skip
            faster = sum(ours < other for ours, other in pairs)
            won = f"{faster} of {len(pairs)}" if pairs else "n/a"
            print(f"| {size} | {name} | {med(hv)} | {med(mv)} | {ratio} | {won} "
                  f"| {paired(pairs)} |")  # fmt: skip
    print(
        "\nTTFT: first streamed token of decode's request, both requests sent at once as"
        " SGLang's router does (prefill's compute, the transfer and decode's first step)."
        " Transfer: SGLang's own sglang:kv_transfer_latency_ms on prefill, the same code for"
        " both backends (the last chunk queued for transfer to the transfer's success)."
        " Both pairs ran at once, with --sleep-on-idle, their rounds taking turns (which"
        " backend goes first alternates); the last two columns compare the two requests of"
        " each round, which ran back to back."
    )
    print(
        f"\nCPU between requests, cores (prefill + decode, over {common.IDLE_S:.0f} s with"
        f" nothing in flight, both pairs up): handoff {common.cores_text(idle.get('handoff'))},"
        f" mooncake (tcp) {common.cores_text(idle.get('mooncake'))}."
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", required=True, help="the venv's folder (logs go under logs/)")
    ap.add_argument("--transport", default="auto", help="handoff: auto | ucx | tcp")
    ap.add_argument("--reps", type=int, default=30, help="timed rounds per prompt size")
    ap.add_argument("--skip-mooncake", action="store_true", help="only the handoff backend")
    ap.add_argument("--only", choices=("sizes", "faults", "seed3"), action="append",
                    help="run only these parts (repeatable; default: all)")  # fmt: skip
    args = ap.parse_args()
    (Path(args.dir) / "tiny").mkdir(parents=True, exist_ok=True)
    (Path(args.dir) / "tiny" / "config.json").write_text(json.dumps(TINY_CONFIG, indent=1))
    args.prefill_port, args.decode_port = free_port(), free_port()
    args.bootstrap_port = free_port()
    servers: list[Server] = []
    rows: dict[str, dict[int, list[dict]]] = {}
    idle: dict[str, list[float]] = {}
    parts = set(args.only or ("sizes", "faults", "seed3"))
    try:
        refs = references(args)
        if parts & {"sizes", "faults"}:
            # 1. Both backends' pairs up at once; their rounds interleaved: tokens and
            # timings.
            backends = [("handoff", "handoff")]
            if "sizes" in parts and not args.skip_mooncake:
                backends.append(("mooncake", "mooncake_tcp"))
            pairs: dict[str, argparse.Namespace] = {}
            up: dict[str, tuple[Server, Server]] = {}
            for label, backend in backends:
                pairs[label] = pair_args(args)
                extra = SIZES_EXTRA if "sizes" in parts else []
                up[label] = (
                    start_server(pairs[label], f"{label}-prefill", backend, "prefill", 0,
                                 extra=extra),
                    start_server(pairs[label], f"{label}-decode", backend, "decode", 1,
                                 extra=extra),
                )  # fmt: skip
                servers += up[label]
            wait_up([s for pair in up.values() for s in pair])
            if "sizes" in parts:
                rows = run_sizes(pairs, refs)
                # With --sleep-on-idle, SGLang's own processes sleep too.
                idle = {label: common.idle_cores(list(up[label])) for label in up}
                common.check_idle("handoff", idle["handoff"])
            for label, (p, d) in up.items():
                p.stop()
                if label != "handoff":
                    d.stop()
            if "faults" in parts:
                # 2. Prefill killed after its prefill; 3. decode killed while prefill
                # computes.
                hargs = pairs["handoff"]
                d = up["handoff"][1]
                servers.append(prefill_loss(hargs, d))
                servers.append(decode_loss(hargs, d))
            for s in servers:
                s.stop()
        # 5. Seed 003: pipeline-parallel prefill and a saturated decode, both backends.
        if "seed3" in parts:
            seed3(args, refs)
    except Exception as e:  # any failure of the run itself is one failed check
        check("the run itself", False, f"{type(e).__name__}: {e}")
    finally:
        for s in servers:
            s.stop()
    if rows:
        summarize(rows, idle)
    return common.finish()


if __name__ == "__main__":
    sys.exit(main())
