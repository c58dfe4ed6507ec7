"""Real vLLM P/D through handoff's connector, then through NixlConnector, side by side.

Run by scripts/vllm-e2e.sh inside its venv (it needs only the standard library here; the
vLLM servers are separate processes). Prints one line per check (`PASS`/`FAIL`), then a
table of timings for both connectors, and exits 0 only when every check passed.

A tiny Llama (4 layers, hidden 256, 2 KV heads, vocab 1024) with dummy weights gives every
instance the same seeded weights, so decode's greedy tokens after a transfer must equal the
tokens prefill computes alone for the same prompt. The heterogeneous TP pairings (TP 1 to 2,
TP 2 to 1) load a checkpoint of the same model written here with seeded random weights
instead: dummy weights are drawn per TP rank, so instances of different TP sizes would hold
different models.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import e2e_common as common
from e2e_common import SIZES, TINY_CONFIG, ServerProcess, check, free_port, prompt

DECODE_TOKENS = 8
#: Seconds a vLLM instance may take to come up on a 2-core machine.
STARTUP_S_MAX = 420
#: Seconds within which decode must answer a request whose prefill died.
PREFILL_LOSS_ANSWER_S_MAX = 10.0
#: Seconds within which prefill must free a request's blocks after decode died.
DECODE_LOSS_FREE_S_MAX = 10.0
#: The TTL prefill runs with in these checks: freeing must come well before it.
TTL_S = 120


class Server(ServerProcess):
    """One vLLM OpenAI server process: the dummy-weight tiny model, or, with ``tp`` above 1,
    the checkpoint `real_checkpoint` wrote (its ``tp`` workers bound to cores 0 and 1)."""

    def __init__(self, args, name: str, port: int, cpu: int, kv: dict, env: dict, tp: int = 1):
        full_env = dict(os.environ)
        full_env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="|".join(str(c % 2) for c in range(cpu, cpu + tp)),
            PYTHONUNBUFFERED="1",
            VLLM_LOGGING_LEVEL="INFO",
        )
        full_env.update(env)
        # The TP pairings in float32: decode's steps at one TP size against the reference's
        # at another round differently, and bf16's rounding flips near-ties of this random
        # model's greedy tokens within a few steps (seen at 512 tokens, TP 2 to 1).
        weights = (
            ["--load-format", "dummy", "--dtype", "bfloat16"]
            if args.model_dir is None
            else ["--dtype", "float32"]
        )
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model(args), *weights, "--tensor-parallel-size", str(tp),
            "--skip-tokenizer-init", "--max-model-len", "4096",
            "--host", "127.0.0.1", "--port", str(port),
            "--kv-transfer-config", json.dumps(kv),
        ]  # fmt: skip
        super().__init__(name, port, Path(args.dir) / f"{name}.log", cmd, full_env)


def wait_up(servers: list[Server]) -> None:
    common.wait_up(servers, STARTUP_S_MAX)


def post(port: int, body: dict, timeout: float = 300) -> tuple[float, dict | None, str]:
    """POST /v1/completions: (seconds, json or None, error text)."""
    return common.post_json(port, "/v1/completions", body, timeout)


def stream(port: int, body: dict, timeout: float = 300):
    """Streamed completion: (seconds to the first token, total seconds, token ids, error)."""
    body = dict(body, stream=True)
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
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
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter() - t
                    tokens.extend(ids)
    except urllib.error.HTTPError as e:
        return (
            None,
            time.perf_counter() - t,
            tokens,
            f"HTTP {e.code}: {e.read()[:200]!r}",
        )
    except (urllib.error.URLError, OSError) as e:
        return None, time.perf_counter() - t, tokens, str(e)
    return first, time.perf_counter() - t, tokens, ""


def metrics(port: int) -> dict[str, float]:
    """Prometheus samples summed over labels: name -> value."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return out
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            with contextlib.suppress(ValueError):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def model(args) -> str:
    return args.model_dir or str(Path(args.dir) / "tiny")


def prefill_request(args, p: list[int]) -> tuple[float, dict | None, str]:
    return post(args.prefill_port, {
        "model": model(args), "prompt": p, "max_tokens": 1, "temperature": 0,
        "return_token_ids": True,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    })  # fmt: skip


def reference(args, p: list[int]) -> list[int] | None:
    """What the prefill instance computes alone (a salted prefix cache: recomputed)."""
    _, r, _ = post(args.prefill_port, {
        "model": model(args), "prompt": p, "max_tokens": DECODE_TOKENS, "temperature": 0,
        "return_token_ids": True, "cache_salt": "reference",
    })  # fmt: skip
    return None if r is None else r["choices"][0]["token_ids"]


def handoff_kv(args, role: str, extra: dict | None = None, engine: str = "") -> dict:
    return {
        "kv_connector": "HandoffConnector",
        "kv_connector_module_path": "handoff.vllm",
        "kv_role": role,
        "engine_id": engine or f"vllm-{role}",
        "kv_connector_extra_config": {
            "bootstrap": args.bootstrap, "transport": args.transport, "ttl_s": TTL_S,
            # Each request's states, timestamped by the runtime (`runtime_times`).
            "log": RUNTIME_LOG,
            # More options for both sides, to try others: HANDOFF_E2E_EXTRA='{"mode": "push"}'.
            **json.loads(os.environ.get("HANDOFF_E2E_EXTRA") or "{}"),
            **(extra or {}),
        },
    }  # fmt: skip


def nixl_kv(role: str) -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": role}


def start_pair(args, kv_p: dict, kv_d: dict, env_p=None, env_d=None):
    p = Server(args, f"{args.label}-prefill", args.prefill_port, 0, kv_p, env_p or {})
    d = Server(args, f"{args.label}-decode", args.decode_port, 1, kv_d, env_d or {})
    wait_up([p, d])
    return p, d


def pd_round(args, size: int, salt: int) -> dict:
    """One request through prefill then decode; returns its measurements."""
    p = prompt(size, salt)
    before = metrics(args.decode_port)
    dp, rp, err = prefill_request(args, p)
    if rp is None:
        return {"error": f"prefill: {err}"}
    params = rp.get("kv_transfer_params")
    ttft, total, tokens, err = stream(args.decode_port, {
        "model": model(args), "prompt": p, "max_tokens": DECODE_TOKENS, "temperature": 0,
        "return_token_ids": True, "kv_transfer_params": params,
    })  # fmt: skip
    after = metrics(args.decode_port)
    hits = after.get("vllm:external_prefix_cache_hits_total", 0) - before.get(
        "vllm:external_prefix_cache_hits_total", 0
    )
    xfer_n = after.get("vllm:nixl_xfer_time_seconds_count", 0) - before.get(
        "vllm:nixl_xfer_time_seconds_count", 0
    )
    xfer_s = after.get("vllm:nixl_xfer_time_seconds_sum", 0) - before.get(
        "vllm:nixl_xfer_time_seconds_sum", 0
    )
    return {
        "prompt": p, "prefill_s": dp, "ttft_s": ttft, "decode_s": total, "tokens": tokens,
        "error": err, "hits": hits, "params": params,
        "nixl_xfer_s": xfer_s / xfer_n if xfer_n else None,
    }  # fmt: skip


#: The runtime's log filter on the HandoffConnector servers: request opened / state lines.
RUNTIME_LOG = (
    "warn,handoff_actors::runtime=debug,handoff_actors::request=debug,handoff_net::control=info"
)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: A line's spans (the root's `root{..}`, a request's `request{..}`, with spaces inside)
#: come before its target.
_STAMPED = re.compile(
    r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z\s+DEBUG (?:\w+\{[^}]*\}: )*\S+: "
    r"(request opened|state changed) request=(\S+) role=decode(?: state=(\w+))?"
)


def runtime_times(d: Server, since: int) -> list[tuple[float, float]]:
    """Per decode request, from the runtime's own timestamps: (receiver opened -> Done,
    read posted -> Done), in ms. The read is decode's `Transferring` (entered as it posts
    the read of prefill's blocks) to `Done`: what NIXL's xfer time measures for its read."""
    text = _ANSI.sub("", d.text(since))
    seen: dict[str, dict[str, datetime.datetime]] = {}
    for m in _STAMPED.finditer(text):
        stamp = datetime.datetime.fromisoformat(m.group(1)[:26])
        what = "opened" if m.group(2) == "request opened" else m.group(4)
        seen.setdefault(m.group(3), {})[what] = stamp
    out = []
    for marks in seen.values():
        if {"opened", "Transferring", "Done"} <= marks.keys():
            done = marks["Done"]
            out.append((_ms(marks["opened"], done), _ms(marks["Transferring"], done)))
    return out


def _ms(a: datetime.datetime, b: datetime.datetime) -> float:
    return (b - a).total_seconds() * 1000.0


def handoff_times(d: Server, since: int) -> list[float]:
    """Decode-side handoff times our connector logged (receiver opened -> blocks in)."""
    text = d.text(since)
    return [
        float(m) for m in re.findall(r"handoff decode request \S+: \d+ blocks in ([\d.]+) ms", text)
    ]


def prefill_loss(args, p_srv: Server, d_srv: Server, label: str) -> None:
    """Prefill killed after its prefill: decode answers within seconds, keeps serving."""
    pr = prompt(300, 4242)
    _, rp, err = prefill_request(args, pr)
    if rp is None:
        check(f"{label}: prefill killed after prefill", False, f"prefill failed: {err}")
        return
    p_srv.kill()
    dt, rd, err = post(args.decode_port, {
        "model": model(args), "prompt": pr, "max_tokens": 4, "temperature": 0,
        "return_token_ids": True, "kv_transfer_params": rp.get("kv_transfer_params"),
    }, timeout=120)  # fmt: skip
    outcome = "tokens" if rd is not None else err
    check(
        f"{label}: prefill killed after prefill -> decode answers that request in seconds",
        dt < PREFILL_LOSS_ANSWER_S_MAX, f"{dt:.2f} s ({outcome})",
    )  # fmt: skip
    _, rd2, err2 = post(args.decode_port, {
        "model": model(args), "prompt": prompt(100, 4343), "max_tokens": 4, "temperature": 0,
        "return_token_ids": True,
    })  # fmt: skip
    check(f"{label}: decode keeps serving after its prefill died", rd2 is not None, err2)


def decode_loss(args, p_srv: Server, d_srv: Server) -> None:
    """Decode killed mid-handoff: prefill frees the request's blocks by peer loss."""
    pr = prompt(700, 5151)
    mark = p_srv.log_size()
    _, rp, err = prefill_request(args, pr)
    if rp is None:
        check("handoff: decode killed mid-handoff", False, f"prefill failed: {err}")
        return
    usage_held = metrics(args.prefill_port).get("vllm:kv_cache_usage_perc", 0)
    worker = threading.Thread(
        target=post,
        args=(args.decode_port, {
            "model": model(args), "prompt": pr, "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": rp.get("kv_transfer_params"),
        }, 60),
        daemon=True,
    )  # fmt: skip
    worker.start()
    seen = p_srv.wait_log(r"handoff prefill request \S+: decode is ready", mark, 60)
    if seen is None:
        check("handoff: decode killed mid-handoff", False, "decode never reached prefill")
        return
    d_srv.kill()
    killed_at = time.strftime("%H:%M:%S")
    t = time.monotonic()
    freed = p_srv.wait_log(
        r"handoff prefill request \S+ released \d+ blocks \(failed", seen[1], TTL_S
    )
    dt = time.monotonic() - t
    check(
        "handoff: decode killed mid-handoff -> prefill frees the blocks by peer loss",
        freed is not None and dt < DECODE_LOSS_FREE_S_MAX,
        f"{dt:.2f} s after the kill (TTL {TTL_S} s): "
        + (freed[0].strip()[-160:] if freed else f"never (killed at {killed_at}, on {seen[0]})"),
    )  # fmt: skip
    deadline = time.monotonic() + 10
    usage = metrics(args.prefill_port).get("vllm:kv_cache_usage_perc", 0)
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        usage = metrics(args.prefill_port).get("vllm:kv_cache_usage_perc", 0)
    check(
        "handoff: prefill's KV cache usage back to zero after decode died",
        usage == 0, f"{usage_held:.4f} held -> {usage:.4f}",
    )  # fmt: skip


def summarize(
    rows: dict[str, dict[int, list[dict]]],
    handoff_ms: dict[int, list[float]],
    runtime_ms: dict[int, list[tuple[float, float]]],
    idle: dict[str, list[float]],
):
    def med(xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            return "n/a"
        return f"{statistics.median(xs) * 1000:.1f} ({min(xs) * 1000:.1f}-{max(xs) * 1000:.1f})"

    print("\nTimings, ms: median (min-max) over the timed requests of each size")
    print("| prompt | metric | HandoffConnector | NixlConnector | ratio (nixl/handoff) |")
    print("|---|---|---|---|---|")
    for size in SIZES:
        h, n = rows.get("handoff", {}).get(size, []), rows.get("nixl", {}).get(size, [])
        for key, name in (("ttft_s", "decode TTFT"), ("prefill_s", "prefill request")):
            hv, nv = [r[key] for r in h], [r[key] for r in n]
            ratio = "n/a"
            if hv and nv and all(x is not None for x in hv + nv):
                ratio = f"{statistics.median(nv) / statistics.median(hv):.2f}"
            print(f"| {size} | {name} | {med(hv)} | {med(nv)} | {ratio} |")
        hx = [x / 1000 for x in handoff_ms.get(size, [])]
        nx = [r["nixl_xfer_s"] for r in n]
        # Different spans (ours has a control round trip and a step boundary; NIXL's is its
        # read alone): no ratio. "The read itself" below is the like-for-like pair.
        ratio = "n/a (spans differ)"
        print(f"| {size} | handoff (transfer) | {med(hx)} | {med(nx)} | {ratio} |")
        rt = runtime_ms.get(size, [])
        opened = [a / 1000 for a, _ in rt]
        print(f"| {size} | handoff in the runtime | {med(opened)} | n/a | n/a |")
        read = [b / 1000 for _, b in rt]
        ratio = "n/a"
        if read and [x for x in nx if x]:
            ratio = f"{statistics.median([x for x in nx if x]) / statistics.median(read):.2f}"
        print(f"| {size} | the read itself | {med(read)} | {med(nx)} | {ratio} |")
    print(
        f"\nCPU between requests, cores (prefill + decode, each its own instance, over"
        f" {common.IDLE_S:.0f} s with nothing in flight): HandoffConnector"
        f" {common.cores_text(idle.get('handoff'))}, NixlConnector"
        f" {common.cores_text(idle.get('nixl'))}. On this machine's two cores, what an idle"
        " connector spins is taken from its own engine's forward passes."
    )
    print(
        "\nTTFT: first streamed token of the decode request (the transfer, one forward pass"
        " and scheduling). Transfer: HandoffConnector = decode's receiver opened to the engine"
        " step that sees the blocks in (control round trip and a step boundary included);"
        " NixlConnector = vllm:nixl_xfer_time_seconds (its read, from post to the status"
        " check that saw it done). Handoff in the runtime: decode's receiver opened to Done,"
        " by the runtime's timestamps (transfer info, prefill's Ready, the read). The read"
        " itself: decode's read of prefill's blocks, posted to done, by the same timestamps:"
        " the same span as NIXL's number."
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", required=True, help="the venv's folder (logs go there)")
    ap.add_argument("--handoff", required=True, help="the handoff binary")
    ap.add_argument("--transport", default="auto", help="auto | ucx | tcp")
    ap.add_argument("--reps", type=int, default=10, help="timed requests per prompt size")
    ap.add_argument("--skip-nixl", action="store_true", help="only HandoffConnector")
    ap.add_argument(
        "--skip-tp", action="store_true", help="no heterogeneous TP pairings (TP 1 and 2)"
    )
    ap.add_argument("--only-tp", action="store_true", help="only the TP pairings")
    args = ap.parse_args()
    args.model_dir = None
    (Path(args.dir) / "tiny").mkdir(parents=True, exist_ok=True)
    (Path(args.dir) / "tiny" / "config.json").write_text(json.dumps(TINY_CONFIG, indent=1))
    args.prefill_port, args.decode_port = free_port(), free_port()
    bport = free_port()
    args.bootstrap = f"tcp://127.0.0.1:{bport}"
    boot_log = open(Path(args.dir) / "bootstrap.log", "w")  # noqa: SIM115 - the run's length
    boot = subprocess.Popen(
        [args.handoff, "bootstrap", "--listen", args.bootstrap],
        stdout=boot_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    servers: list[Server] = []
    rows: dict[str, dict[int, list[dict]]] = {}
    handoff_ms: dict[int, list[float]] = {}
    runtime_ms: dict[int, list[tuple[float, float]]] = {}
    idle: dict[str, list[float]] = {}
    try:
        if not args.only_tp:
            # 1. HandoffConnector: correctness and timings.
            args.label = "handoff"
            p, d = start_pair(
                args, handoff_kv(args, "kv_producer"), handoff_kv(args, "kv_consumer")
            )
            servers += [p, d]
            for size in SIZES:
                handoff_ms[size] = []
            rows["handoff"] = {}
            for si, size in enumerate(SIZES):
                mark = d.log_size()
                part = run_connector_size(args, "handoff", size, si)
                rows["handoff"][size] = part
                handoff_ms[size] = handoff_times(d, mark)[1:]  # the warm-up's is dropped
                runtime_ms[size] = runtime_times(d, mark)[1:]
            idle["handoff"] = common.idle_cores([p, d])
            common.check_idle("handoff", idle["handoff"])
            # 2. Prefill killed after its prefill.
            prefill_loss(args, p, d, "handoff")
            # 3. Decode killed mid-handoff (prefill hands its blocks over late, as a slow
            #    engine would, so that decode dies while prefill still holds them).
            args.label = "handoff-slow"
            p2 = Server(args, "handoff-slow-prefill", args.prefill_port, 0,
                        handoff_kv(args, "kv_producer", {"send_delay_ms": 20000}), {})  # fmt: skip
            servers.append(p2)
            wait_up([p2])
            decode_loss(args, p2, d)
            for s in servers:
                s.stop()
        # 4. Heterogeneous TP: prefill and decode of different TP sizes, both ways.
        if not args.skip_tp:
            tp_pairings(args, servers)
            for s in servers:
                s.stop()
        # 5. NixlConnector on the same prompts.
        if not args.skip_nixl and not args.only_tp:
            args.label = "nixl"
            env_p = {
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            }
            env_d = {
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            }
            p, d = start_pair(args, nixl_kv("kv_producer"), nixl_kv("kv_consumer"), env_p, env_d)
            servers += [p, d]
            rows["nixl"] = {}
            for si, size in enumerate(SIZES):
                rows["nixl"][size] = run_connector_size(args, "nixl", size, si)
            idle["nixl"] = common.idle_cores([p, d])
    except Exception as e:  # any failure of the run itself is one failed check
        check("the run itself", False, f"{type(e).__name__}: {e}")
    finally:
        for s in servers:
            s.stop()
        boot.terminate()
        boot.wait(timeout=10)
    summarize(rows, handoff_ms, runtime_ms, idle)
    return common.finish()


#: The TP pairings run on real vLLM: (prefill's TP size, decode's).
TP_PAIRS = ((1, 2), (2, 1))


def real_checkpoint(args) -> str:
    """The tiny model with real weights (a seeded random init, float32, saved as safetensors) in the
    run's folder: dummy weights are drawn per TP rank, so instances of different TP sizes
    would not hold the same model; a checkpoint is sharded the same way by both."""
    path = Path(args.dir) / "tiny-real-f32"
    if not (path / "model.safetensors").exists():
        code = (
            "import json, sys, torch\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "cfg = json.load(open(sys.argv[1]))\n"
            "cfg.pop('architectures')\n"
            "torch.manual_seed(20261127)\n"
            "m = LlamaForCausalLM(LlamaConfig(**cfg))\n"
            "m.save_pretrained(sys.argv[2], safe_serialization=True)\n"
        )
        config = Path(args.dir) / "tiny" / "config.json"
        subprocess.run([sys.executable, "-c", code, str(config), str(path)], check=True)
    return str(path)


def tp_pairings(args, servers: list[Server]) -> None:
    """Heterogeneous TP on real vLLM (a real checkpoint of the tiny model: 2 KV heads):
    prefill at TP 1 and decode at TP 2 (each decode rank takes its one head from the one
    prefill rank), and prefill at TP 2 and decode at TP 1 (decode gathers its two heads
    from both), all four instances up together. Per prompt size, decode's greedy tokens
    equal what its prefill instance computes alone, and decode counts the prompt as an
    external prefix-cache hit."""
    args.model_dir = real_checkpoint(args)
    pairs = []
    for ptp, dtp in TP_PAIRS:
        ports = (free_port(), free_port())
        name = f"tp{ptp}to{dtp}"
        kv_p = handoff_kv(args, "kv_producer", engine=f"{name}-prefill")
        kv_d = handoff_kv(args, "kv_consumer", engine=f"{name}-decode")
        p = Server(args, f"{name}-prefill", ports[0], 0, kv_p, {}, tp=ptp)
        d = Server(args, f"{name}-decode", ports[1], 1, kv_d, {}, tp=dtp)
        servers += [p, d]
        pairs.append((ptp, dtp, ports))
    wait_up(servers[-2 * len(TP_PAIRS) :])
    saved = (args.prefill_port, args.decode_port)
    try:
        for ptp, dtp, ports in pairs:
            args.prefill_port, args.decode_port = ports
            warm_up(args, f"tp {ptp} -> {dtp}", salt=9000 + 100 * ptp + 10 * dtp)
            for si, size in enumerate(SIZES):
                r = pd_round(args, size, salt=7000 + 100 * ptp + 10 * dtp + si)
                label = f"tp {ptp} -> {dtp}: {size}-token prompt"
                if r.get("error"):
                    check(label, False, r["error"])
                    continue
                check_round(args, label, size, r)
    finally:
        args.prefill_port, args.decode_port = saved
        args.model_dir = None


#: Unchecked rounds a pair may take to come up, at most.
WARM_UP_ROUNDS_MAX = 3


def warm_up(args, label: str, salt: int) -> None:
    """Unchecked rounds until one completes (at most `WARM_UP_ROUNDS_MAX`), before a
    pair's checked ones. With six vLLM workers on two cores, a TP 2 instance's first forward
    pass has kept both of its processes from running our runtime for 15-30 s (no answer to
    decode's dials, its bootstrap heartbeat lapsed), so decode's first requests failed as
    `peer_lost`, cleanly, after three unanswered dials: a cold start on an oversubscribed
    host, not what these rounds check (how heads pair across TP sizes). The count is
    printed, so a pair that needed more than one shows in the log."""
    for n in range(1, WARM_UP_ROUNDS_MAX + 1):
        r = pd_round(args, SIZES[0], salt=salt + n)
        if not r.get("error") and r.get("tokens"):
            print(f"{label}: up after {n} warm-up round(s)", flush=True)
            return
        print(f"{label}: warm-up round {n} failed: {r.get('error') or 'no tokens'}", flush=True)


def check_round(args, label: str, size: int, r: dict) -> None:
    """A round's checks: decode's greedy tokens equal what its prefill instance computes
    alone, and decode counted the prompt as an external prefix-cache hit."""
    ref = reference(args, r["prompt"])
    check(
        f"{label}, decode's greedy tokens equal prefill alone",
        ref is not None and r["tokens"] == ref,
        f"decode {r['tokens']} reference {ref}",
    )  # fmt: skip
    check(
        f"{label} counted as an external prefix-cache hit",
        r["hits"] >= size - 1, f"{r['hits']:.0f} tokens",
    )  # fmt: skip


def run_connector_size(args, label: str, size: int, si: int) -> list[dict]:
    out = []
    for rep in range(args.reps + 1):  # the first round is checked, not timed
        r = pd_round(args, size, salt=1000 * si + rep)
        if r.get("error"):
            check(f"{label}: {size}-token prompt round {rep}", False, r["error"])
            continue
        if rep == 0:
            check_round(args, f"{label}: {size}-token prompt", size, r)
            continue
        out.append(r)
    return out


if __name__ == "__main__":
    sys.exit(main())
