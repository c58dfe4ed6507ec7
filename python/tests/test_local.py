"""Prefill and decode runtimes in this process, numpy arrays as their KV caches."""

from __future__ import annotations

import contextlib
import os

import handoff
import numpy as np
import pytest
from conftest import until

BLOCKS, BLOCK_BYTES = 32, 4096


def runtime(role: str, engine: str, bootstrap, kv: np.ndarray, **kw) -> handoff.Runtime:
    kw.setdefault("transport", "tcp")
    return handoff.Runtime(role, engine, bootstrap.address, [kv], heartbeat_ms=200, **kw)


@pytest.fixture
def pair(bootstrap, request):
    mode = getattr(request, "param", "push")
    kv_p = np.zeros((BLOCKS, BLOCK_BYTES), np.uint8)
    kv_d = np.zeros((BLOCKS, BLOCK_BYTES), np.uint8)
    with (
        runtime("prefill", "P", bootstrap, kv_p) as p,
        runtime("decode", "D", bootstrap, kv_d, mode=mode) as d,
    ):
        yield p, d, kv_p, kv_d


def released(rt: handoff.Runtime, events: list[handoff.Event]) -> list[int]:
    events += rt.drain_events()
    return sorted(b for e in events if e.kind == "released" for b in e.blocks)


@pytest.mark.parametrize("pair", ["push", "pull"], indirect=True)
def test_numpy_arrays_hand_over_byte_for_byte(pair):
    p, d, kv_p, kv_d = pair
    rng = np.random.default_rng(7)
    jobs = []
    for n in range(4):
        src = [4 * n + k for k in range(4)]
        dst = [31 - (4 * n + k) for k in range(4)]
        kv_p[src] = rng.integers(0, 256, (4, BLOCK_BYTES), dtype=np.uint8)
        r = d.receiver(f"req-{n}", "P", blocks=dst)
        s = p.sender(f"req-{n}")
        s.send(src)
        jobs.append((s, r, src, dst))
    states = d.wait([r for _, r, _, _ in jobs], timeout_s=30)
    assert states == {f"req-{n}": "Done" for n in range(4)}
    for s, r, src, dst in jobs:
        assert s.wait(30) == "Done" and r.poll() == "Done" and r.reason is None
        assert np.array_equal(kv_d[dst], kv_p[src]), f"{r.id}: bytes differ"
    # Every block handed over comes back in exactly one `released` event, on both sides.
    ev_p: list[handoff.Event] = []
    ev_d: list[handoff.Event] = []
    until(lambda: released(p, ev_p) == list(range(16)), "prefill releases its 16 blocks")
    until(lambda: released(d, ev_d) == list(range(16, 32)), "decode releases its 16 blocks")
    finals = [e for e in ev_d if e.kind == "state" and e.state == "Done"]
    assert len(finals) == 4


@pytest.mark.parametrize("pair", ["push", "pull"], indirect=True)
def test_aux_bytes_travel_beside_the_kv(pair):
    p, d, kv_p, kv_d = pair
    kv_p[3] = 9
    r = d.receiver("aux", "P", blocks=[30])
    s = p.sender("aux")
    payload = bytes(range(256)) * 40  # SGLang's first token and metadata are this order
    s.send([3], aux=payload)
    assert r.wait(30) == "Done" and s.wait(30) == "Done"
    assert np.array_equal(kv_d[30], kv_p[3])
    assert r.aux == [(p.rank, payload)]
    # Without a payload, decode gets none; too large a one is refused before anything moves.
    r2 = d.receiver("plain", "P", blocks=[29])
    p.sender("plain").send([4])
    assert r2.wait(30) == "Done" and r2.aux == []
    s3 = p.sender("big")
    with pytest.raises(handoff.InvalidInput):
        s3.send([5], aux=b"x" * (handoff._native.AUX_BYTES_MAX + 1))
    s3.abort()


def test_abort_frees_blocks_and_tells_the_peer(pair):
    p, d, _, _ = pair
    r = d.receiver("gone", "P", blocks=[5, 6, 7])
    s = p.sender("gone")
    until(lambda: s.poll() == "WaitingForInput", "prefill hears from decode")
    r.abort()
    with pytest.raises(handoff.Aborted) as e:
        r.wait(5)
    assert e.value.reason == "aborted_by_engine" and r.reason == "aborted_by_engine"
    ev: list[handoff.Event] = []
    until(lambda: released(d, ev) == [5, 6, 7], "decode's aborted blocks released")
    failed = [x for x in ev if x.kind == "state" and x.state == "Failed"]
    assert failed and failed[0].reason == "aborted_by_engine" and failed[0].detail
    # The peer fails by name, fast, and blocks it gets afterwards stay the engine's.
    with pytest.raises(handoff.AbortedByPeer):
        s.wait(5)
    with pytest.raises(handoff.RequestEnded):
        s.send([1, 2])
    ev_p: list[handoff.Event] = []
    assert released(p, ev_p) == []


def test_prefill_abort_after_send_releases_its_blocks(pair):
    p, _, _, _ = pair
    s = p.sender("never-read")
    s.send([9, 10])
    s.abort()
    with pytest.raises(handoff.Aborted):
        s.wait(5)
    ev: list[handoff.Event] = []
    until(lambda: released(p, ev) == [9, 10], "prefill's blocks released")


def test_wait_times_out_by_name_and_the_request_goes_on(pair):
    p, _, _, _ = pair
    s = p.sender("slow")
    with pytest.raises(handoff.WaitTimeout) as e:
        s.wait(0.2)
    assert isinstance(e.value, TimeoutError) and "slow" in e.value.detail
    assert s.poll() == "Bootstrapping"
    with pytest.raises(handoff.WaitTimeout):
        p.wait(["slow"], timeout_s=0.1)


def test_shutdown_fails_live_requests_and_releases_their_blocks(bootstrap):
    kv = np.zeros((8, 256), np.uint8)
    p = runtime("prefill", "P1", bootstrap, kv)
    s = p.sender("live")
    s.send([1, 2, 3])
    assert p.shutdown(10) is True
    assert p.shutdown() is True  # idempotent
    with pytest.raises(handoff.InternalError):
        s.wait(5)
    ev: list[handoff.Event] = []
    assert released(p, ev) == [1, 2, 3]
    with pytest.raises(handoff.RuntimeStopped):
        p.sender("after")
    assert not p.running


def test_a_runtime_whose_rank_a_newer_one_takes_says_so_and_fails_its_requests(bootstrap):
    kv_old, kv_new = np.zeros((8, 256), np.uint8), np.zeros((8, 256), np.uint8)
    with runtime("prefill", "P2", bootstrap, kv_old) as old:
        s = old.sender("waiting")
        s.send([1, 2])
        assert old.superseded is None
        with runtime("prefill", "P2", bootstrap, kv_new) as newer:
            with pytest.raises(handoff.Superseded) as failed:
                s.wait(30)
            assert old.superseded is not None
            assert str(newer.incarnation) in old.superseded
            assert old.superseded in str(failed.value)
            assert newer.superseded is None
            assert "handoff_superseded 1" in old.metrics_text()
            ev: list[handoff.Event] = []
            assert released(old, ev) == [1, 2]


def test_blocking_calls_release_the_gil(pair):
    import threading

    p, _, _, _ = pair
    s = p.sender("parked")
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        before = ticks
        with pytest.raises(handoff.WaitTimeout):
            s.wait(0.5)
        during = ticks - before
    finally:
        stop.set()
        t.join(5)
    # Python code ran in another thread all the while the wait blocked.
    assert during > 1000, during


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_forked_child_is_refused_by_name_and_never_hangs(pair):
    import gc
    import os
    import time

    p, _, _, _ = pair
    pid = os.fork()
    if pid == 0:  # the child: the runtime's threads stayed with the parent
        code = 1
        try:
            p.sender("from-child")
        except handoff.RuntimeStopped:
            code = 0
        except BaseException:
            code = 2
        del p
        gc.collect()  # dropping it must not wait for threads that are not here
        os._exit(code)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child hung")
    # The parent's runtime is untouched.
    p.sender("from-parent").abort()


@pytest.mark.parametrize("pair", ["push", "pull"], indirect=True)
def test_an_end_and_its_release_are_seen_together(pair):
    """An engine woken by a request's end finds its blocks released in the same drain (on
    one CPU, the waiter can run between two separate updates: the end would then be seen
    a step before its blocks come back)."""
    p, d, _, _ = pair
    cpus = os.sched_getaffinity(0)
    pin_threads({min(cpus)})  # the runtimes' threads as well
    try:
        for n in range(40):
            r = d.receiver(f"pair-{n}", "P", blocks=[n % BLOCKS])
            p.sender(f"pair-{n}").send([n % BLOCKS])
            assert d.wait([r], timeout_s=30) == {f"pair-{n}": "Done"}
            mine = [e for e in d.drain_events() if e.request_id == f"pair-{n}"]
            assert [e.kind for e in mine][-2:] == ["state", "released"], mine
    finally:
        pin_threads(cpus)


def pin_threads(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def test_a_load_wait_grows_with_the_bytes_and_zero_means_never():
    from handoff._runtime import LoadWait

    assert LoadWait(2.0, 1.0).seconds(4 << 20) == pytest.approx(0.006)
    assert LoadWait(2.0, 0.0).seconds(1 << 30) == pytest.approx(0.002)
    assert LoadWait(0.0, 1.0).seconds(4 << 20) == 0.0


def test_metrics_are_served_and_count_the_requests(bootstrap):
    """``metrics_listen`` serves the runtime's Prometheus metrics over HTTP; the numbers are
    the run's (requests done, blocks given back, none held) and ``metrics_text`` says the
    same without a listener."""
    import urllib.request

    kv_p = np.zeros((BLOCKS, BLOCK_BYTES), np.uint8)
    kv_d = np.zeros((BLOCKS, BLOCK_BYTES), np.uint8)
    with (
        runtime("prefill", "P", bootstrap, kv_p) as p,
        runtime("decode", "D", bootstrap, kv_d, mode="pull", metrics_listen="127.0.0.1:0") as d,
    ):
        assert p.metrics_address is None
        host, _, port = d.metrics_address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        handles = []
        for n in range(3):
            r = d.receiver(f"m-{n}", "P", blocks=[10 + n])
            p.sender(f"m-{n}").send([n])
            handles.append(r)
        assert d.wait(handles, timeout_s=30) == {f"m-{n}": "Done" for n in range(3)}
        url = f"http://{d.metrics_address}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            assert answer.status == 200
            assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = answer.read().decode()
        samples = dict(
            line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
        )
        assert samples['handoff_requests_total{role="decode",outcome="done",reason=""}'] == "3"
        assert samples['handoff_blocks_held{role="decode"}'] == "0"
        assert samples['handoff_blocks_released_total{role="decode",why="done"}'] == "3"
        assert samples['handoff_transfers_total{transport="tcp",op="read",outcome="ok"}'] == "3"
        assert samples["handoff_block_bytes"] == str(BLOCK_BYTES)
        bytes_read = 'handoff_transfer_bytes_total{transport="tcp",op="read"}'
        assert samples[bytes_read] == str(3 * BLOCK_BYTES)
        assert (
            'handoff_requests_total{role="decode",outcome="done",reason=""} 3' in d.metrics_text()
        )


def threads() -> dict[int, tuple[str, int]]:
    """Every thread of this process: id -> (name, nice value)."""
    out: dict[int, tuple[str, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[int(tid)] = (name, int(fields[16]))  # field 19 of stat: nice
    return out


@contextlib.contextmanager
def new_runtime_threads(**kw):
    """Starts a runtime; yields it and `nices(want)`: the nice values of the threads it
    started (tokio's and, over UCX, the plane's; threads other tests' runtimes left are not
    counted) once they all read `want`, or as they read after 10 s. A thread takes its
    value as it starts, so one seen just born (tokio starts blocking threads on demand)
    still has the engine's: `nices` waits for it."""
    before = set(threads())
    with runtime(**kw) as rt:

        def nices(want: int) -> set[int]:
            def now() -> set[int]:
                mine = {
                    t: v
                    for t, v in threads().items()
                    if t not in before and v[0].startswith("handoff-")
                }
                names = {n for n, _ in mine.values()}
                assert "handoff-rt" in names, f"new threads: {mine}"
                if rt.transport == "ucx":
                    assert any(n.startswith("handoff-ucx") for n in names), f"new threads: {mine}"
                return {nice for _, nice in mine.values()}

            # (Past the wait, the values as they are: the caller's assertion shows them.)
            with contextlib.suppress(AssertionError):
                until(lambda: now() == {want}, f"runtime threads at nice {want}", timeout_s=10)
            return now()

        yield rt, nices


def test_runtime_threads_take_their_nice_value_and_the_engine_keeps_its_own(bootstrap):
    kv = np.zeros((BLOCKS, BLOCK_BYTES), np.uint8)
    engine_nice = os.getpriority(os.PRIO_PROCESS, 0)
    # A higher nice value needs no privilege, so this holds for any user.
    with new_runtime_threads(
        role="prefill", engine="P", bootstrap=bootstrap, kv=kv, transport="auto", thread_nice=19
    ) as (_, nices):
        assert nices(19) == {19}
        assert os.getpriority(os.PRIO_PROCESS, 0) == engine_nice
    with new_runtime_threads(
        role="prefill", engine="P1", bootstrap=bootstrap, kv=kv, thread_nice=None
    ) as (_, nices):
        assert nices(engine_nice) == {engine_nice}, "None leaves them as they were born"
    for bad in (-21, 20, "high", True):
        with pytest.raises(handoff.InvalidInput, match="thread_nice"):
            runtime("prefill", "P2", bootstrap, kv, thread_nice=bad)


def test_by_default_runtime_threads_run_ahead_of_the_engine_where_allowed(bootstrap):
    """Default -10: root (CI) may take it; a user without CAP_SYS_NICE keeps its own nice
    value, and the runtime works as before (it logs the refusal once)."""
    kv_p, kv_d = (
        np.zeros((BLOCKS, BLOCK_BYTES), np.uint8),
        np.zeros((BLOCKS, BLOCK_BYTES), np.uint8),
    )
    engine_nice = os.getpriority(os.PRIO_PROCESS, 0)
    allowed = True
    try:
        os.setpriority(os.PRIO_PROCESS, 0, handoff.THREAD_NICE_DEFAULT)
        os.setpriority(os.PRIO_PROCESS, 0, engine_nice)
    except PermissionError:
        allowed = False
    want = handoff.THREAD_NICE_DEFAULT if allowed else engine_nice
    with (
        new_runtime_threads(
            role="prefill", engine="P", bootstrap=bootstrap, kv=kv_p, transport="auto"
        ) as (p, pn),
        new_runtime_threads(
            role="decode", engine="D", bootstrap=bootstrap, kv=kv_d, transport="auto", mode="pull"
        ) as (d, dn),
    ):
        assert pn(want) == dn(want) == {want}
        kv_p[2] = 7
        r = d.receiver("nice", "P", blocks=[1])
        p.sender("nice").send([2])
        assert r.wait(30) == "Done" and np.array_equal(kv_d[1], kv_p[2])


NO_CAP_SYS_NICE = r"""
import os, sys
import numpy as np
import handoff

handoff.init_logging("warn,handoff_transport::priority=info")
try:
    os.setpriority(os.PRIO_PROCESS, 0, -1)
    print("still allowed")
    sys.exit(3)
except PermissionError:
    pass
engine_nice = os.getpriority(os.PRIO_PROCESS, 0)
server = handoff.bootstrap_server("tcp://127.0.0.1:0")
kv_p, kv_d = np.zeros((8, 4096), np.uint8), np.zeros((8, 4096), np.uint8)
kv_p[3] = 5
with (
    handoff.Runtime("prefill", "P", server.address, [kv_p], transport="auto") as p,
    handoff.Runtime("decode", "D", server.address, [kv_d], transport="auto") as d,
):
    nices = set()
    for tid in os.listdir("/proc/self/task"):
        stat = open(f"/proc/self/task/{tid}/stat").read()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name.startswith("handoff-"):
            nices.add(int(stat[stat.rindex(")") + 2 :].split()[16]))
    r = d.receiver("r", "P", blocks=[6])
    p.sender("r").send([3])
    done = r.wait(30)
    print("nices", sorted(nices), "engine", engine_nice, done, bool((kv_d[6] == 5).all()))
server.stop()
"""


def test_without_cap_sys_nice_threads_keep_the_engines_priority_and_say_so_once(tmp_path):
    """Where the process may not lower a nice value, the runtime starts, its threads keep the
    engine's, a transfer runs, and the refusal is logged once (not once per thread)."""
    import shutil
    import subprocess
    import sys

    cmd = [sys.executable, "-c", NO_CAP_SYS_NICE]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.fail("running as root, this test drops CAP_SYS_NICE with setpriv (util-linux)")
        cmd = [setpriv, "--bounding-set=-sys_nice", "--inh-caps=-sys_nice", *cmd]
    # Away from the source tree, so that the child imports the installed package.
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nices [0] engine 0 Done True" in out.stdout, out.stdout + out.stderr
    refusals = out.stderr.count("runtime threads keep the engine's priority")
    assert refusals == 1, out.stderr
