"""The engine-facing runtime: `Runtime`, `Event`, `BootstrapServer`."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple, Union

from . import _native
from ._errors import InvalidInput
from ._kv import KvSpec, _int, kv_spec

SenderHandle = _native.SenderHandle
ReceiverHandle = _native.ReceiverHandle
Handle = Union[_native.SenderHandle, _native.ReceiverHandle]

#: Lifecycle deadlines, seconds, as `handoff worker` and the Rust runtime default them.
TIMEOUTS_DEFAULT = {
    "bootstrap_s": 300.0,
    "waiting_s": 300.0,
    "transfer_s": 60.0,
    "pull_ttl_s": 480.0,
}

#: The nice value of a runtime's own threads unless told otherwise (``thread_nice``).
THREAD_NICE_DEFAULT: int = _native.THREAD_NICE_DEFAULT


class LoadWait(NamedTuple):
    """How long an engine connector waits for a load it has just started: ``base_ms`` plus
    ``per_mib_ms`` for each MiB the load moves; never when ``base_ms`` is 0."""

    base_ms: float = 2.0
    per_mib_ms: float = 1.0

    def seconds(self, nbytes: int) -> float:
        if self.base_ms <= 0:
            return 0.0
        return (self.base_ms + self.per_mib_ms * nbytes / (1 << 20)) / 1000.0


class Event(NamedTuple):
    """Something the engine should know, from `Runtime.drain_events`.

    ``kind`` is ``"state"`` (``state`` is the new state; ``reason``/``detail`` name the
    failure when it is ``"Failed"``) or ``"released"`` (the runtime no longer holds
    ``blocks``: on prefill the engine may free them; on decode after ``Done`` they hold the
    KV cache). Every block handed to the runtime appears in exactly one ``released`` event.

    A ``released`` event says why in ``why``: ``"done"`` (delivered, or arrived),
    ``"failed"`` (``reason``/``detail`` name the failure; ``fence`` is ``"confirmed"`` when
    the blocks were held until every peer confirmed it could no longer touch them,
    ``"bound"`` when held until the fence bound passed, ``None`` when released at once),
    ``"late"`` (handed over after the request ended) or ``"shutdown"`` (the runtime stopped).
    """

    request_id: str
    kind: str
    state: str | None
    reason: str | None
    blocks: list[int]
    detail: str | None = None
    why: str | None = None
    fence: str | None = None


def _str(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise InvalidInput(f"{name} must be a str, not {type(v).__name__}")
    return v


def _seconds(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidInput(f"{name} must be a number of seconds, not {type(v).__name__}")
    return float(v)


class Runtime:
    """One worker's handoff runtime: what an engine embeds (one per GPU worker process).

    Construction starts the data plane over ``kv_caches`` (registered by address, never
    copied), binds the control port and registers with the bootstrap server; it blocks (GIL
    released) until registered or ``register_timeout_s``. Every other call returns at once
    except `wait` and `shutdown`, which release the GIL and take a timeout.

    Secure by default: a listen, advertised or bootstrap address that is not loopback needs
    a shared secret (``secret_file``, else ``HANDOFF_SECRET_FILE`` or ``HANDOFF_SECRET`` from
    the environment) or ``insecure=True``; otherwise `InsecureRefused` is raised.

    ``metrics_listen="HOST:PORT"`` serves the runtime's Prometheus metrics at
    ``http://HOST:PORT/metrics`` (port 0 picks one: see ``metrics_address``); `metrics_text`
    gives the same text without a listener.

    ``thread_nice`` is the nice value of the runtime's own threads (-20..19; default
    `THREAD_NICE_DEFAULT`, -10), so that an engine loop spinning on every core does not keep
    the thread that answers a peer or sends a heartbeat waiting for one. Lowering a nice
    value takes ``CAP_SYS_NICE`` (or an ``RLIMIT_NICE`` that allows it): without it the
    threads keep the engine's priority and the runtime logs that once. ``None`` leaves them
    as they are.

    ``tcp_busy_poll_us`` (0..1000, or None, the default): over TCP, wait for bytes spinning
    that long before the thread sleeps, on both sides (each small operation's answer, each
    next frame), for lower one-block latency at the price of the CPU spun: for workers with
    cores to spare; 0 never spins. ``None``: only a client spins, up to 100 µs, for the
    answer to an operation of at most 256 KiB (one wake-up fewer per one-block transfer),
    and nothing spins while the runtime is idle.

    ``kv_heads`` (the model's KV heads, all ``tp_size`` ranks together), ``head_size``
    (elements per head) and ``head_order`` (``"hnd"``: each head's tokens together;
    ``"nhd"``: each token's heads together, vLLM's default; ``"latent"`` for MLA) say how
    every K or V part of a block holds this rank's share of the heads, with
    ``block_tokens`` and ``dtype_bytes``. Both sides need them to hand over between
    different TP sizes (one ``tp_size`` must divide the other): each decode rank then
    gathers its heads from its share of prefill's ranks, or takes its share of one prefill
    rank's heads.
    """

    def __init__(
        self,
        role: str,
        engine: str,
        bootstrap: str,
        kv_caches: Any,
        *,
        num_blocks: int | None = None,
        device: str | None = None,
        layers: tuple[int, int, int] | None = None,
        block_tokens: int | None = None,
        dtype_bytes: int | None = None,
        kv_heads: int | None = None,
        head_size: int | None = None,
        head_order: str = "hnd",
        dp_rank: int = 0,
        dp_size: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        transport: str = "auto",
        mode: str = "pull",
        control_listen: str = "tcp://127.0.0.1:0",
        data_listen: str = "127.0.0.1:0",
        advertise_host: str | None = None,
        timeouts: dict[str, float] | None = None,
        heartbeat_ms: int = 5000,
        heartbeats_missed: int = 6,
        secret_file: str | os.PathLike[str] | None = None,
        admission: int | None = None,
        register_timeout_s: float = 30.0,
        insecure: bool = False,
        metrics_listen: str | None = None,
        thread_nice: int | None = THREAD_NICE_DEFAULT,
        tcp_busy_poll_us: int | None = None,
    ) -> None:
        spec: KvSpec = kv_spec(kv_caches, num_blocks, device)
        t = dict(TIMEOUTS_DEFAULT)
        for k, v in (timeouts or {}).items():
            if k not in t:
                raise InvalidInput(f"unknown timeout {k!r}; known: {', '.join(t)}")
            t[k] = _seconds(k, v)
        if layers is not None:
            if not (isinstance(layers, tuple) and len(layers) == 3):
                raise InvalidInput("layers must be (first, count, total)")
            layers = tuple(_int("layers", x) for x in layers)  # type: ignore[assignment]
        ints = {
            "dp_rank": dp_rank,
            "dp_size": dp_size,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "pp_rank": pp_rank,
            "pp_size": pp_size,
            "heartbeat_ms": heartbeat_ms,
            "heartbeats_missed": heartbeats_missed,
        }
        if tcp_busy_poll_us is not None:
            ints["tcp_busy_poll_us"] = tcp_busy_poll_us
        for k, v in ints.items():
            _int(k, v)
        if admission is not None:
            _int("admission", admission, 1)
        tokens = spec.block_tokens if block_tokens is None else _int("block_tokens", block_tokens)
        element = spec.dtype_bytes if dtype_bytes is None else _int("dtype_bytes", dtype_bytes)
        head_bytes = 0
        if kv_heads is not None:
            _int("kv_heads", kv_heads, 1)
            if head_size is None or tokens == 0 or element == 0:
                raise InvalidInput(
                    "kv_heads needs head_size, block_tokens and dtype_bytes (the tensors' "
                    "element size, or given)"
                )
            head_bytes = _int("head_size", head_size, 1) * element
        elif head_size is not None:
            raise InvalidInput("head_size without kv_heads")
        if thread_nice is not None and (
            isinstance(thread_nice, bool) or not isinstance(thread_nice, int)
        ):
            raise InvalidInput(
                f"thread_nice must be an int or None, not {type(thread_nice).__name__}"
            )
        self._native = _native.Runtime(
            _str("role", role),
            _str("engine", engine),
            _str("bootstrap", bootstrap),
            [tuple(r) for r in spec.ranges],
            spec.num_blocks,
            device=spec.device,
            layers=layers,
            block_tokens=tokens,
            dtype_bytes=element,
            kv_heads=0 if kv_heads is None else kv_heads,
            head_order=_str("head_order", head_order),
            head_bytes=head_bytes,
            transport=_str("transport", transport),
            mode=_str("mode", mode),
            control_listen=_str("control_listen", control_listen),
            data_listen=_str("data_listen", data_listen),
            advertise_host=None
            if advertise_host is None
            else _str("advertise_host", advertise_host),
            bootstrap_s=t["bootstrap_s"],
            waiting_s=t["waiting_s"],
            transfer_s=t["transfer_s"],
            pull_ttl_s=t["pull_ttl_s"],
            register_timeout_s=_seconds("register_timeout_s", register_timeout_s),
            secret_file=None if secret_file is None else os.fspath(secret_file),
            admission=admission,
            keep=tuple(spec.owners),
            insecure=bool(insecure),
            metrics_listen=None
            if metrics_listen is None
            else _str("metrics_listen", metrics_listen),
            thread_nice=thread_nice,
            **ints,
        )
        self.kv: KvSpec = spec
        self._handles: weakref.WeakValueDictionary[str, Handle] = weakref.WeakValueDictionary()

    # --- who this is ---------------------------------------------------------------------

    role = property(lambda self: self._native.role, doc='"prefill" or "decode".')
    engine = property(lambda self: self._native.engine, doc="This worker's engine id.")
    rank = property(lambda self: self._native.rank, doc="This worker's rank, as text.")
    control_address = property(lambda self: self._native.control_address)
    data_address = property(lambda self: self._native.data_address)
    transport = property(lambda self: self._native.transport, doc='"tcp" or "ucx".')
    incarnation = property(lambda self: self._native.incarnation)
    num_blocks = property(lambda self: self._native.num_blocks)
    block_bytes = property(lambda self: self._native.block_bytes)
    running = property(lambda self: self._native.running, doc="True until `shutdown`.")
    superseded = property(
        lambda self: self._native.superseded,
        doc="What the directory said once a newer process holds this worker's rank (every "
        "request then fails `Superseded`: stop this process), else None.",
    )
    metrics_address = property(
        lambda self: self._native.metrics_address,
        doc="Where ``metrics_listen`` serves Prometheus metrics (``HOST:PORT``), or None.",
    )

    def metrics_text(self) -> str:
        """The runtime's metrics now, in the Prometheus text format (what ``/metrics`` serves)."""
        return self._native.metrics_text()

    # --- requests ------------------------------------------------------------------------

    def sender(self, request_id: str) -> _native.SenderHandle:
        """Opens a prefill request; call ``send(blocks)`` on it once its KV cache is computed."""
        h = self._native.sender(_str("request_id", request_id))
        self._handles[request_id] = h
        return h

    def receiver(
        self,
        request_id: str,
        prefill_engine: str,
        dp_rank: int | None = None,
        blocks: Iterable[int] | None = None,
    ) -> _native.ReceiverHandle:
        """Opens a decode request receiving from ``prefill_engine`` (at ``dp_rank``, or the
        lowest registered); ``blocks`` now, or later with ``allocate``."""
        if dp_rank is not None:
            _int("dp_rank", dp_rank)
        h = self._native.receiver(
            _str("request_id", request_id), _str("prefill_engine", prefill_engine), dp_rank, blocks
        )
        self._handles[request_id] = h
        return h

    def drain_events(self) -> list[Event]:
        """Every event since the last call, oldest first. Never blocks."""
        return [Event(*e) for e in self._native.drain_events()]

    def open_requests(self) -> int:
        """Requests open now: live, or ended with their final event not drained yet."""
        return self._native.open_requests()

    def wait(self, requests: Iterable[Handle | str], timeout_s: float) -> dict[str, str]:
        """Blocks (GIL released) until every request has ended: ``{id: "Done" | "Failed"}``.
        Takes handles, or ids of handles still alive. Raises `WaitTimeout` naming the
        requests still live after ``timeout_s``."""
        handles = []
        for r in requests:
            if isinstance(r, str):
                h = self._handles.get(r)
                if h is None:
                    raise InvalidInput(f"no live handle for request {r!r}; pass the handle")
                handles.append(h)
            else:
                handles.append(r)
        return dict(self._native.wait(handles, _seconds("timeout_s", timeout_s)))

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Stops the runtime (GIL released, at most ``timeout_s``): live requests fail and
        their blocks are released; events can still be drained. Idempotent. Returns whether
        it stopped in time."""
        return self._native.shutdown(_seconds("timeout_s", timeout_s))

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return repr(self._native)


class BootstrapServer:
    """A bootstrap server in this process (tests, single-host setups); `address` is what
    workers pass as ``bootstrap``. Stops on `stop`, on leaving a ``with`` block, or when
    garbage-collected. For a standalone one, run ``handoff bootstrap``."""

    def __init__(
        self,
        listen: str = "tcp://127.0.0.1:0",
        *,
        secret_file: str | os.PathLike[str] | None = None,
        expire_after_s: float | None = None,
        insecure: bool = False,
    ) -> None:
        self._native = _native.BootstrapServer(
            _str("listen", listen),
            secret_file=None if secret_file is None else os.fspath(secret_file),
            expire_after_s=None
            if expire_after_s is None
            else _seconds("expire_after_s", expire_after_s),
            insecure=bool(insecure),
        )

    @property
    def address(self) -> str:
        return self._native.address

    def stop(self) -> None:
        self._native.stop()

    def __enter__(self) -> BootstrapServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return repr(self._native)


def bootstrap_server(
    listen: str = "tcp://127.0.0.1:0",
    *,
    secret_file: str | os.PathLike[str] | None = None,
    expire_after_s: float | None = None,
    insecure: bool = False,
) -> BootstrapServer:
    """Starts a bootstrap server in this process (see `BootstrapServer`)."""
    return BootstrapServer(
        listen, secret_file=secret_file, expire_after_s=expire_after_s, insecure=insecure
    )
