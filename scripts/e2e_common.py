"""What the real-engine end-to-end runs share (scripts/vllm_e2e.py, scripts/sglang_e2e.py):
checks, prompts, server processes and waiting for them. Standard library only: each run
imports it from its own venv, with this folder on `sys.path` (Python puts a script's own
folder there)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

#: A tiny Llama (4 layers, hidden 256, 2 KV heads, vocab 1024): with dummy weights, every
#: instance has the same seeded weights, so a disaggregated request's tokens must equal a
#: single server's.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
#: Prompt sizes, in tokens.
SIZES = (64, 512, 2048)

#: Every check of the run: (name, passed, detail).
results: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    """Records and prints one check (`PASS`/`FAIL`)."""
    results.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def finish() -> int:
    """Prints the count of checks passed; the run's exit status (0 only if all passed)."""
    failed = [name for name, ok, _ in results if not ok]
    print(f"\n{len(results) - len(failed)} of {len(results)} checks passed")
    return 1 if failed else 0


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now, for a server started next. Taken below the kernel's ephemeral range
    (`ip_local_port_range`), where no socket bound to port 0 and no outgoing connection can
    take it before the server binds it (a port from bind(0) was taken so in one run here, and
    SGLang, failing to bind, then hung in its shutdown instead of exiting); at least
    100 from every port given before, for engines that use their port's neighbours."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    if low > 12_000:
        for _ in range(1000):
            port = rng.randrange(low - 10_000, low - 100)
            if any(abs(port - p) < 100 for p in _PORTS_GIVEN):
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _PORTS_GIVEN.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(size: int, salt: int) -> list[int]:
    """A prompt no other (size, salt) shares a prefix with: a seeded LCG over the vocab."""
    x = (size * 1_000_003 + salt * 7919 + 12345) & 0xFFFFFFFF
    out = []
    for _ in range(size):
        x = (x * 1_664_525 + 1_013_904_223) & 0xFFFFFFFF
        out.append(10 + (x >> 8) % 1000)
    return out


def post_json(port: int, path: str, payload: dict, timeout: float):
    """POST a JSON body to a local server: (seconds, json or None, error text)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        try:
            return time.perf_counter() - t, json.loads(raw), ""
        except ValueError:
            return time.perf_counter() - t, None, f"not JSON: {raw[:200]!r}"
    except urllib.error.HTTPError as e:
        return time.perf_counter() - t, None, f"HTTP {e.code}: {e.read()[:2000]!r}"
    except (urllib.error.URLError, OSError) as e:
        return time.perf_counter() - t, None, str(e)


#: Seconds a server pair is watched with no request in flight, for the CPU it uses.
IDLE_S = 5.0
#: CPU one of our servers may use between requests, in cores (the engine's own processes
#: included): the runtime waits on events, it does not spin (the cores are the engine's).
IDLE_CORES_MAX = 0.1


def idle_cores(servers: list, seconds: float = IDLE_S) -> list[float]:
    """CPU each server's processes use over `seconds` with no request in flight, in cores
    (after a second for the last request's tail: its release, the engine's idle step)."""
    time.sleep(1.0)
    before = [s.cpu_seconds() for s in servers]
    t = time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t
    return [(s.cpu_seconds() - b) / dt for s, b in zip(servers, before, strict=True)]


def cores_text(cores: list[float] | None) -> str:
    """`0.01 + 0.02`: each server's cores, as the summaries print them."""
    return " + ".join(f"{c:.2f}" for c in cores) if cores else "n/a"


def check_idle(label: str, cores: list[float]) -> None:
    """The check that our servers (`label`) stayed idle between requests."""
    check(
        f"{label}: prefill and decode idle between requests (no spinning)",
        max(cores) < IDLE_CORES_MAX,
        f"cores: {cores_text(cores)}",
    )


def until(cond, timeout_s: float) -> bool:
    """Polls `cond` until it holds or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


class ServerProcess:
    """One engine server process, leading a process group of its own (so a kill reaches the
    workers it spawns), its output in a log file.

    The group stays in this script's session on purpose. A new session (setsid) is a new
    scheduler autogroup on Linux, and autogroups share a CPU as groups: a runtime thread
    woken on the core where another server's group is busy then waits for its own group's
    share of that core, whatever its nice value. Measured here with SGLang, four servers on
    two cores: prefill's transfers stalled 44-85 ms a few times per run with a session each,
    never over 10 ms in one session (ARCHITECTURE.md, "Liveness")."""

    def __init__(self, name: str, port: int, log_path: Path, cmd: list[str], env: dict):
        self.name, self.port, self.log_path = name, port, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, process_group=0
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """CPU time (user and system) the live processes of this server's group have used."""
        total = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            if int(fields[2]) == self.proc.pid:  # its process group
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)

    def raw(self, since: int = 0) -> bytes:
        """The log's bytes from byte `since` on (offsets are bytes, as `log_size` gives them)."""
        with open(self.log_path, "rb") as f:
            f.seek(since)
            return f.read()

    def text(self, since: int = 0) -> str:
        """The log from byte `since` on."""
        return self.raw(since).decode(errors="replace")

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.text().splitlines()[-n:])

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def wait_log(self, pattern: str, since: int, timeout_s: float) -> tuple[str, int] | None:
        """The first line matching `pattern` past byte `since` within the deadline."""
        deadline = time.monotonic() + timeout_s
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            at = since
            for raw in self.raw(since).splitlines(keepends=True):
                at += len(raw)
                line = raw.decode(errors="replace")
                if rx.search(line):
                    return line.rstrip("\n"), at
            time.sleep(0.05)
        return None


def wait_up(servers: list, startup_s: float) -> None:
    """Waits until every server answers /health; if one dies or the deadline passes, stops
    them all (a caller may not hold them yet) and raises."""
    try:
        deadline = time.monotonic() + startup_s
        pending = list(servers)
        while pending and time.monotonic() < deadline:
            for s in list(pending):
                if not s.alive():
                    raise RuntimeError(f"{s.name} died while starting:\n{s.tail()}")
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{s.port}/health", timeout=2)
                    pending.remove(s)
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(1)
        if pending:
            raise RuntimeError(f"{[s.name for s in pending]} not up in {startup_s} s")
    except BaseException:
        for s in servers:
            s.stop()
        raise
