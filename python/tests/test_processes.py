"""Two processes: a peer (peer.py) and this one, through an in-process bootstrap server."""

from __future__ import annotations

import time

import handoff
import numpy as np
import pytest
from conftest import skip_or_fail, until
from peer import pattern

BLOCKS, BLOCK_BYTES = 64, 4096
#: A killed peer resets its sockets, so its loss is noticed at once; the heartbeats
#: (200 ms, 3 missed) bound it otherwise. "Fast" is well under any lifecycle deadline (300 s).
PEER_LOST_WITHIN_S = 5.0


def local(role: str, engine: str, bootstrap, transport: str = "tcp", **kw):
    kv = np.zeros((BLOCKS, BLOCK_BYTES), np.uint8)
    rt = handoff.Runtime(
        role,
        engine,
        bootstrap.address,
        [kv],
        transport=transport,
        heartbeat_ms=200,
        heartbeats_missed=3,
        **kw,
    )
    return rt, kv


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_blocks_hand_over_between_processes_over_tcp(bootstrap, peers, mode):
    prefill = peers(role="prefill", engine="P", bootstrap=bootstrap.address, transport="tcp")
    assert prefill.ready["transport"] == "tcp"
    rt, kv = local("decode", "D", bootstrap, mode=mode)
    with rt:
        for n in range(3):
            src = [10 * n + k for k in range(5)]
            dst = [63 - (10 * n + k) for k in range(5)]
            r = rt.receiver(f"req-{n}", "P", blocks=dst)
            prefill.call(op="send", id=f"req-{n}", blocks=src, seed=100 + n)
            assert r.wait(30) == "Done"
            for k, b in enumerate(dst):
                assert np.array_equal(kv[b], pattern(100 + n, k, BLOCK_BYTES)), f"block {b}"
            end = prefill.call("end", op="wait", id=f"req-{n}", timeout_s=30)
            assert end["state"] == "Done", end


def test_busy_polling_runtimes_hand_over_the_same_bytes(bootstrap, peers):
    """Both sides wait for TCP bytes spinning (`tcp_busy_poll_us`): the same handover."""
    prefill = peers(role="prefill", engine="P", bootstrap=bootstrap.address, tcp_busy_poll_us=200)
    rt, kv = local("decode", "D", bootstrap, mode="pull", tcp_busy_poll_us=200)
    with rt:
        src, dst = [5, 6, 7, 8], [40, 30, 20, 10]
        r = rt.receiver("req-poll", "P", blocks=dst)
        prefill.call(op="send", id="req-poll", blocks=src, seed=11)
        assert r.wait(30) == "Done"
        for k, b in enumerate(dst):
            assert np.array_equal(kv[b], pattern(11, k, BLOCK_BYTES)), f"block {b}"


def test_blocks_hand_over_between_processes_through_etcd(etcd, peers):
    """The same handover with no bootstrap server: both register in a real etcd."""
    prefill = peers(role="prefill", engine="P", bootstrap=etcd.address, transport="tcp")
    rt, kv = local("decode", "D", etcd)
    with rt:
        src, dst = [1, 2, 3], [60, 61, 62]
        r = rt.receiver("req-etcd", "P", blocks=dst)
        prefill.call(op="send", id="req-etcd", blocks=src, seed=7)
        assert r.wait(30) == "Done"
        for k, b in enumerate(dst):
            assert np.array_equal(kv[b], pattern(7, k, BLOCK_BYTES)), f"block {b}"
    # Without etcd, a new runtime cannot register, and says where it looked.
    etcd.kill()
    with pytest.raises(handoff.HandoffError) as failed:
        handoff.Runtime(
            "decode",
            "D2",
            etcd.address,
            [np.zeros((4, 64), np.uint8)],
            transport="tcp",
            register_timeout_s=2.0,
        )
    assert etcd.client in str(failed.value), failed.value


def test_blocks_hand_over_between_processes_over_ucx(bootstrap, peers):
    try:
        rt, kv = local("decode", "D", bootstrap, transport="ucx")
    except handoff.DataPlaneError as e:
        skip_or_fail("ucx", f"the UCX transport did not start: {e}")
    with rt:
        prefill = peers(role="prefill", engine="P", bootstrap=bootstrap.address, transport="ucx")
        r = rt.receiver("u", "P", blocks=[1, 2])
        prefill.call(op="send", id="u", blocks=[5, 6], seed=9)
        assert r.wait(30) == "Done"
        assert all(np.array_equal(kv[b], pattern(9, k, BLOCK_BYTES)) for k, b in enumerate([1, 2]))


def test_a_killed_prefill_fails_decode_fast_with_peer_lost(bootstrap, peers):
    prefill = peers(role="prefill", engine="P", bootstrap=bootstrap.address)
    rt, _ = local("decode", "D", bootstrap)
    with rt:
        r = rt.receiver("doomed", "P", blocks=[1, 2, 3])
        prefill.call(op="open", id="doomed")
        until(
            lambda: prefill.call("state", op="poll", id="doomed")["state"] == "WaitingForInput",
            "prefill has decode's transfer info",
            every_s=0.05,
        )
        assert r.poll() == "WaitingForInput"
        prefill.kill()
        killed = time.monotonic()
        with pytest.raises(handoff.PeerLost) as e:
            r.wait(PEER_LOST_WITHIN_S * 4)
        took = time.monotonic() - killed
        assert took < PEER_LOST_WITHIN_S, f"PeerLost after {took:.1f} s"
        assert e.value.reason == "peer_lost" and "P/" in e.value.detail
        released = sorted(b for x in rt.drain_events() if x.kind == "released" for b in x.blocks)
        if rt.transport == "tcp":
            # Every write is checked against its grant on arrival: the blocks go at once.
            assert released == [1, 2, 3]
        # One-sided (UCX): a lost prefill might still write into the granted blocks, so
        # they may stay fenced (released by the fence's bound): not asserted here.
        print(
            f"decode failed PeerLost {took * 1e3:.0f} ms after prefill was killed "
            f"({rt.transport}; released at once: {released})"
        )


def test_a_killed_decode_fails_prefill_fast_with_peer_lost(bootstrap, peers):
    decode = peers(role="decode", engine="D", bootstrap=bootstrap.address)
    rt, _ = local("prefill", "P", bootstrap)
    with rt:
        waiting = rt.sender("doomed")
        sent = rt.sender("in-flight")
        decode.call(op="recv", id="doomed", prefill="P", blocks=[4, 5])
        decode.call(op="recv", id="in-flight", prefill="P", blocks=[6])
        until(lambda: waiting.poll() == "WaitingForInput", "prefill has decode's transfer info")
        until(lambda: sent.poll() == "WaitingForInput", "prefill has decode's transfer info")
        decode.kill()
        try:  # races the kill: a push into a dead peer, or refused once the loss is known
            sent.send([9])
            handed = [9]
        except handoff.RequestEnded:
            handed = []
        killed = time.monotonic()
        with pytest.raises(handoff.PeerLost):
            waiting.wait(PEER_LOST_WITHIN_S * 4)
        took = time.monotonic() - killed
        assert took < PEER_LOST_WITHIN_S, f"PeerLost after {took:.1f} s"
        # Whichever came first, the transfer's failure or the loss, it is named and fast,
        # and a block handed over comes back.
        with pytest.raises((handoff.PeerLost, handoff.TransferFailed)):
            sent.wait(PEER_LOST_WITHIN_S)
        with pytest.raises(handoff.RequestEnded):
            waiting.send([7, 8])  # after the end: refused, the blocks stay the engine's
        ev: list[handoff.Event] = []
        until(
            lambda: (
                ev.extend(rt.drain_events())
                or sorted(b for x in ev if x.kind == "released" for b in x.blocks) == handed
            ),
            "a handed-over block is released, and only it",
        )
