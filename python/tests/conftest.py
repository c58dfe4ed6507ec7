"""Shared fixtures: a bootstrap server per test, and peers in other processes."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import handoff
import pytest

#: Every wait in these tests has this deadline at most.
DEADLINE_S = 30.0
PEER = Path(__file__).with_name("peer.py")


def skip_or_fail(need: str, why: str) -> None:
    """This test cannot run its real part here because it lacks `need`: it fails, unless the
    run allows that skip (`HANDOFF_SKIP`, comma-separated, default `gpu`; as the Rust tests'
    `handoff_testkit`); then it is skipped and recorded in `HANDOFF_SKIP_LOG` for the run's
    summary."""
    allowed = {n.strip() for n in os.environ.get("HANDOFF_SKIP", "gpu").split(",")}
    test = os.environ.get("PYTEST_CURRENT_TEST", "a test").split(" ")[0]
    if need not in allowed and "all" not in allowed:
        pytest.fail(
            f"{test} cannot run its real part here: {why}. Install what it needs "
            f"(scripts/test.sh does, as root), or let this run skip it: HANDOFF_SKIP={need}"
        )
    log = os.environ.get("HANDOFF_SKIP_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            flat = why.replace("\t", " ").replace("\n", " ")
            f.write(f"{need}\t{test}\t{flat}\n")
    pytest.skip(f"({need}) {why}")


@pytest.fixture
def bootstrap():
    with handoff.bootstrap_server() as server:
        yield server


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """One real etcd member on loopback ports of its own (Debian etcd-server), serving once
    it answers a read; `address` is the `etcd://` bootstrap address of a cluster of its own."""

    def __init__(self, data_dir: Path, cluster: str) -> None:
        client, peer = _free_port(), _free_port()
        self.client = f"127.0.0.1:{client}"
        self.address = f"etcd://{self.client}/{cluster}"
        peer_url = f"http://127.0.0.1:{peer}"
        self.proc = subprocess.Popen(
            ["etcd", "--name", "m0", "--data-dir", str(data_dir),
             "--listen-client-urls", f"http://{self.client}",
             "--advertise-client-urls", f"http://{self.client}",
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"m0={peer_url}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        until(self._serves, f"etcd serving on {self.client}")

    def _serves(self) -> bool:
        import urllib.request

        req = urllib.request.Request(
            f"http://{self.client}/v3/kv/range", data=b'{"key":"AA=="}', method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=1) as answer:
                return answer.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=DEADLINE_S)


@pytest.fixture
def etcd(tmp_path):
    import shutil

    if shutil.which("etcd") is None:
        skip_or_fail("etcd", "no `etcd` on PATH (Debian etcd-server)")
    member = Etcd(tmp_path / "etcd", "pytest")
    try:
        yield member
    finally:
        member.kill()


class Peer:
    """A worker process (peer.py): JSON commands in, JSON lines out, every read bounded."""

    def __init__(self, **cfg: Any) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RUST_LOG": "warn"},
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        self.ready = self.expect("ready")

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, timeout_s: float = DEADLINE_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(
                    f"peer: no {event!r} line (exit {self.proc.poll()}); stderr:\n"
                    + "".join(self.stderr[-40:])
                )
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("event") == event:
                return msg
            if msg.get("event") == "error":
                raise AssertionError(f"peer error: {msg}")

    def call(self, event: str = "ok", **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.expect(event)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=DEADLINE_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=DEADLINE_S)


@pytest.fixture
def peers():
    made: list[Peer] = []

    def spawn(**cfg: Any) -> Peer:
        p = Peer(**cfg)
        made.append(p)
        return p

    yield spawn
    for p in made:
        p.close()


def until(pred, what: str, timeout_s: float = DEADLINE_S, every_s: float = 0.01):
    """Polls ``pred`` until it returns something truthy, or fails naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")
