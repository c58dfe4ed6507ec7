"""Bad input raises a named exception and never takes the interpreter down."""

from __future__ import annotations

import handoff
import numpy as np
import pytest


@pytest.fixture
def prefill(bootstrap):
    kv = np.zeros((16, 512), np.uint8)
    with handoff.Runtime("prefill", "P", bootstrap.address, [kv], transport="tcp") as rt:
        yield rt


@pytest.fixture
def decode(bootstrap):
    kv = np.zeros((16, 512), np.uint8)
    with handoff.Runtime("decode", "D", bootstrap.address, [kv], transport="tcp") as rt:
        yield rt


@pytest.mark.parametrize("blocks", [[16], [3, 99], [-1], [2**40], [2**200]])
def test_block_ids_out_of_range_are_refused(prefill, decode, blocks):
    with pytest.raises(handoff.BlockOutOfRange):
        prefill.sender(f"s{blocks}").send(blocks)
    with pytest.raises(handoff.BlockOutOfRange):
        decode.receiver(f"r{blocks}", "P", blocks=blocks)


@pytest.mark.parametrize("blocks", [None, 3, "abc", [1.5], [None], [object()], [True]])
def test_blocks_of_the_wrong_type_are_refused(prefill, blocks):
    with pytest.raises(handoff.InvalidInput):
        prefill.sender(f"t{blocks!r}").send(blocks)


def test_numpy_block_ids_are_ints(prefill):
    s = prefill.sender("np")
    s.send(np.array([1, 2], dtype=np.int64))
    s.abort()


def test_heartbeats_are_bounded(bootstrap):
    kv = np.zeros((4, 64), np.uint8)
    for kw in (
        {"heartbeat_ms": 2**62},
        {"heartbeat_ms": 1},
        {"heartbeats_missed": 0},
        {"heartbeats_missed": 1},
    ):
        with pytest.raises(handoff.InvalidInput):
            handoff.Runtime("prefill", "P", bootstrap.address, [kv], transport="tcp", **kw)


def test_wrong_calls_are_named(prefill, decode):
    s = prefill.sender("one")
    with pytest.raises(handoff.DuplicateRequest):
        prefill.sender("one")
    with pytest.raises(handoff.InvalidInput, match="named twice"):
        s.send([1, 3, 1])
    s.send([1])
    with pytest.raises(handoff.AlreadyHandedOver):
        s.send([2])
    with pytest.raises(handoff.WrongRole):
        prefill.receiver("r", "P")
    with pytest.raises(handoff.WrongRole):
        decode.sender("s")
    with pytest.raises(handoff.InvalidInput):
        prefill.sender(123)  # type: ignore[arg-type]
    with pytest.raises(handoff.InvalidInput):
        prefill.sender("")
    with pytest.raises(handoff.InvalidInput):
        prefill.sender("x" * 10_000)
    with pytest.raises(handoff.InvalidInput):
        s.wait(-1)
    with pytest.raises(handoff.InvalidInput):
        prefill.wait([object()], 1)  # type: ignore[list-item]


def test_memory_that_cannot_be_registered_is_refused(bootstrap):
    addr = bootstrap.address
    strided = np.zeros((16, 64), np.uint8)[:, ::2]
    fortran = np.asfortranarray(np.zeros((16, 64), np.uint8))
    readonly = np.zeros((16, 64), np.uint8)
    readonly.setflags(write=False)
    for kv in (strided, fortran, readonly, np.zeros((0, 64), np.uint8)):
        with pytest.raises(handoff.LayoutError):
            handoff.Runtime("prefill", "P", addr, [kv], transport="tcp")
    for bad in ([object()], "not a list", [(0, 64, 64)], [(1, 2)]):
        with pytest.raises(handoff.InvalidInput):
            handoff.Runtime("prefill", "P", addr, bad, num_blocks=4, transport="tcp")
    with pytest.raises(handoff.InvalidInput):
        handoff.Runtime("prefill", "P", addr, [handoff.KvRange(4096, 64, 64)], transport="tcp")


@pytest.mark.parametrize(
    "kw",
    [
        {"role": "middle"},
        {"transport": "rdma"},
        {"mode": "both"},
        {"tp_rank": 2, "tp_size": 2},
        {"dp_size": 0},
        {"timeouts": {"waiting_s": 0}},
        {"timeouts": {"nope_s": 1}},
        {"timeouts": {"waiting_s": float("nan")}},
        {"engine": ""},
        {"admission": 0},
        {"heartbeat_ms": -5},
        {"secret_file": "/nonexistent/secret"},
        {"layers": (3, 2, 4)},
        {"tcp_busy_poll_us": 1001},
        {"tcp_busy_poll_us": -1},
    ],
)
def test_bad_settings_are_refused_by_name(bootstrap, kw):
    args = {"role": "prefill", "engine": "P", "transport": "tcp"}
    args.update(kw)
    kv = np.zeros((4, 64), np.uint8)
    with pytest.raises(handoff.InvalidInput):
        handoff.Runtime(args.pop("role"), args.pop("engine"), bootstrap.address, [kv], **args)


def test_an_unreachable_bootstrap_server_fails_the_start_by_name():
    kv = np.zeros((4, 64), np.uint8)
    with pytest.raises(handoff.RegisterFailed) as e:
        handoff.Runtime(
            "prefill", "P", "tcp://127.0.0.1:9", [kv], transport="tcp", register_timeout_s=0.5
        )
    assert isinstance(e.value, handoff.StartError) and "127.0.0.1:9" in str(e.value)


def test_off_loopback_without_a_secret_is_refused_until_one_is_set(monkeypatch, tmp_path):
    monkeypatch.delenv("HANDOFF_SECRET", raising=False)
    monkeypatch.delenv("HANDOFF_SECRET_FILE", raising=False)
    with pytest.raises(handoff.InsecureRefused) as e:
        handoff.BootstrapServer("tcp://0.0.0.0:0")
    assert "HANDOFF_SECRET_FILE" in str(e.value) and isinstance(e.value, handoff.StartError)
    kv = np.zeros((4, 64), np.uint8)
    with pytest.raises(handoff.InsecureRefused) as e:
        handoff.Runtime(
            "prefill",
            "P",
            "tcp://127.0.0.1:9",
            [kv],
            transport="tcp",
            control_listen="tcp://0.0.0.0:0",
        )
    assert "control listen" in str(e.value)
    with handoff.BootstrapServer("tcp://0.0.0.0:0", insecure=True) as server:
        assert ":0" not in server.address  # started, on a port of its own
    secret = tmp_path / "secret"
    secret.write_text("a-secret-of-at-least-16-bytes\n")
    monkeypatch.setenv("HANDOFF_SECRET_FILE", str(secret))
    with handoff.BootstrapServer("tcp://0.0.0.0:0") as server:
        port = server.address.rsplit(":", 1)[1]
        rt = handoff.Runtime(
            "prefill",
            "P",
            f"tcp://127.0.0.1:{port}",
            [kv],
            transport="tcp",
            control_listen="tcp://0.0.0.0:0",
            data_listen="0.0.0.0:0",
        )
        assert not rt.control_address.startswith("tcp://0.0.0.0")
        rt.shutdown()
