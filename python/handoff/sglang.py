"""An SGLang transfer backend that moves KV cache through handoff.

Installed with the package; SGLang finds it through its ``sglang.srt.plugins`` entry point
(no SGLang source is patched) and uses it when a server runs with
``--disaggregation-transfer-backend handoff``::

    HANDOFF_BOOTSTRAP=tcp://PREFILL_HOST:8998 python -m sglang.launch_server ... \\
        --disaggregation-mode prefill --disaggregation-transfer-backend handoff \\
        --disaggregation-bootstrap-port 8998
    HANDOFF_BOOTSTRAP=tcp://PREFILL_HOST:8998 python -m sglang.launch_server ... \\
        --disaggregation-mode decode --disaggregation-transfer-backend handoff

How SGLang's pieces map onto handoff:

- **Discovery.** Handoff's own bootstrap server replaces SGLang's HTTP one: the prefill
  server runs it in-process on ``--disaggregation-bootstrap-port`` (unless
  ``HANDOFF_BOOTSTRAP`` names one on another port, e.g. a ``handoff bootstrap``), and every
  scheduler process registers there. A prefill instance registers under the engine id
  ``HOST:BOOTSTRAP_PORT``, which is what a router sends decode as ``bootstrap_host`` and
  ``bootstrap_port``; ``bootstrap_room`` becomes the handoff request id on both sides.
- **Lifecycle.** ``KVPoll`` is handoff's lifecycle one to one (Bootstrapping,
  WaitingForInput, Transferring, Success = Done, Failed). A request is reported ``Success``
  or ``Failed`` only once handoff has released its pages, so SGLang never frees or reuses a
  page that a transfer may still touch; ``failure_exception`` raises the
  `handoff.HandoffError` subclass that names the reason (``PeerLost``, ``Timeout``, ...).
  Decode reports ``WaitingForInput`` as soon as its receiver is open (SGLang then allocates
  the pages), and holds at most ``HANDOFF_BOOTSTRAP_TIMEOUT_S`` for prefill to be found.
- **KV layout.** ``KVArgs.kv_data_ptrs`` (per-layer K and V buffers, or one latent buffer
  per layer for MLA) are registered by address, a page being one block, in layer order, with
  the layer span of a pipeline stage (``prefill_start_layer``).
- **Aux data.** The request's metadata row (first output token, logprobs, bootstrap room,
  ...) is read from prefill's ``aux_data_ptrs`` at the request's ``aux_index`` and travels
  with the KV as handoff's per-request payload; decode writes it into its own row before it
  reports ``Success``.
- **Chunked prefill.** ``send`` is called once per chunk; the pages are handed to handoff
  with the last chunk.
- **Pipeline parallelism.** Each prefill stage registers its layers as a rank of its own;
  decode's receiver pairs with every stage and decides the request's outcome for all of
  them. When SGLang fails a request on a stage because another stage failed it (its
  consensus of stages), ``failure_exception`` ends that stage's request too
  (``aborted_by_engine``).

Not supported yet (refused by name at start, never silently wrong): the state buffers of
hybrid (Mamba, SWA) models, speculative-decoding draft KV, data-parallel attention, a
decode-side prefix cache (``decode_prefix_len``), staging buffers, aux rows in GPU memory.

Options, as environment variables of both servers (SGLang has no per-backend config):

``HANDOFF_BOOTSTRAP``
    ``tcp://HOST:PORT`` of the bootstrap server, or ``etcd://HOST:PORT[,...][/CLUSTER]``
    of an etcd cluster (then no server runs). Decode needs it; prefill defaults to the
    one it serves on ``--disaggregation-bootstrap-port``.
``HANDOFF_ENGINE_ID``
    Prefill: the name it registers under (default ``HOST:BOOTSTRAP_PORT``, HOST being
    ``SGLANG_HOST_IP`` or ``--host``).
``HANDOFF_TRANSPORT``
    ``auto`` (UCX when libucp loads, else TCP), ``ucx`` or ``tcp``. Default ``auto``.
``HANDOFF_MODE``
    Decode: ``pull`` (default: decode reads prefill's pages, so a failure is answered at
    once) or ``push``.
``HANDOFF_BOOTSTRAP_TIMEOUT_S``, ``HANDOFF_WAITING_TIMEOUT_S``, ``HANDOFF_TRANSFER_TIMEOUT_S``
    Lifecycle deadlines in seconds; the first two default to SGLang's own
    ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``
    (300), the last to 60.
``HANDOFF_TTL_S``
    Prefill, pull mode: how long finished pages wait to be read (default 120).
``HANDOFF_HEARTBEAT_MS``, ``HANDOFF_HEARTBEATS_MISSED``
    Peer liveness (defaults 1000 and 3: a silent peer is lost after about 3 s; a killed
    one at once, by its reset connections).
``HANDOFF_CONTROL_LISTEN``, ``HANDOFF_DATA_LISTEN``, ``HANDOFF_ADVERTISE_HOST``
    Where each scheduler process listens (defaults ``tcp://127.0.0.1:0``, ``127.0.0.1:0``)
    and the host peers dial when it listens on all interfaces.
``HANDOFF_LOG``
    The runtime's own log filter (``RUST_LOG`` syntax, to stderr; default ``warn``). Every
    line names its request id; ``handoff_actors=debug`` shows each request's states.
``HANDOFF_SECRET_FILE`` (or ``HANDOFF_SECRET``)
    A file holding a shared secret (or the secret): every connection is then
    authenticated. Needed when the bootstrap server or a worker listens on, or dials, an
    address that is not loopback (SGLang's ``--host 0.0.0.0`` included).
``HANDOFF_INSECURE``
    ``1`` to run without a secret on non-loopback addresses (a trusted network only).
``HANDOFF_ADMISSION``
    Decode: refuse new transfers while this many wait for pages.
``HANDOFF_LOAD_WAIT_MS``, ``HANDOFF_LOAD_WAIT_MS_PER_MIB``
    Decode: the first poll that finds a request's read under way waits for it (GIL
    released) up to ``HANDOFF_LOAD_WAIT_MS`` (default 2; 0: never) plus
    ``HANDOFF_LOAD_WAIT_MS_PER_MIB`` (default 1) per MiB it moves, so SGLang sees it done
    in this pass of its loop, and on a CPU server the copy has the core to itself meanwhile.
``HANDOFF_THREAD_NICE``
    The nice value of the runtime's threads (default -10, so that SGLang's scheduler
    spinning on its core does not keep them from one; it takes ``CAP_SYS_NICE``, else they
    keep SGLang's and the runtime logs that once); ``none`` leaves them as they are.
``HANDOFF_TCP_BUSY_POLL_US``
    Over TCP, wait for bytes spinning up to this many microseconds (0 to 1000) before the
    runtime's thread sleeps, on both sides: lower one-block latency for the CPU spun, for
    servers with cores to spare; 0 never spins. Unset (the default): only a client spins,
    up to 100 µs, for the answer to a small operation, and nothing spins while idle.
``HANDOFF_SEND_DELAY_MS``
    Fault injection for tests: prefill hands its pages to handoff this long after its
    last chunk, as a slow prefill would.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)

import handoff
from handoff._runtime import LoadWait

#: The name of the backend on SGLang's command line.
BACKEND = "handoff"

#: Under SGLang's logger, so that its handlers and level apply.
log = logging.getLogger("sglang.srt.disaggregation.handoff")

__all__ = [
    "BACKEND",
    "HandoffKVBootstrapServer",
    "HandoffKVManager",
    "HandoffKVReceiver",
    "HandoffKVSender",
    "register",
]


# ----------------------------------------------------------------------- plugging in


def register() -> None:
    """SGLang plugin entry point (``sglang.srt.plugins``): makes ``handoff`` a choice of
    ``--disaggregation-transfer-backend`` and hands SGLang this module's classes for it.
    Runs in every SGLang process, before arguments are parsed."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _add_enum_member()
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND
    )


def _add_enum_member() -> None:
    """SGLang turns the backend name into its ``TransferBackend`` enum; give the enum a
    ``HANDOFF`` member (Python enums cannot be subclassed once they have members)."""
    from sglang.srt.disaggregation.utils import TransferBackend

    if BACKEND in TransferBackend._value2member_map_:
        return
    member = object.__new__(TransferBackend)
    member._name_ = "HANDOFF"
    member._value_ = BACKEND
    member.__init__()
    TransferBackend._member_map_["HANDOFF"] = member
    TransferBackend._value2member_map_[BACKEND] = member
    TransferBackend._member_names_.append("HANDOFF")
    type.__setattr__(TransferBackend, "HANDOFF", member)


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.utils import KVClassType

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: HandoffKVManager,
        KVClassType.SENDER: HandoffKVSender,
        KVClassType.RECEIVER: HandoffKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: HandoffKVBootstrapServer,
    }[class_type]


# -------------------------------------------------------------------------- options


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def _thread_nice() -> int | None:
    """``HANDOFF_THREAD_NICE``: the runtime threads' nice value, or ``none``."""
    raw = os.environ.get("HANDOFF_THREAD_NICE", "").strip().lower()
    if raw in ("none", "off"):
        return None
    return _env_int("HANDOFF_THREAD_NICE", handoff.THREAD_NICE_DEFAULT)


def _insecure() -> bool:
    """``HANDOFF_INSECURE``: run without a secret off loopback (a trusted network only)."""
    return os.environ.get("HANDOFF_INSECURE", "").strip().lower() in ("1", "true", "yes")


def _connect_host(host: str | None) -> str:
    if not host or host in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return host


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -------------------------------------------------------------------- bootstrap server


class HandoffKVBootstrapServer(BaseKVBootstrapServer):
    """Runs handoff's bootstrap server on the prefill's bootstrap port (in SGLang's HTTP
    process), unless ``HANDOFF_BOOTSTRAP`` names one on another port (run elsewhere)."""

    def __init__(self, host: str, port: int, **_: Any):
        self.server: handoff.BootstrapServer | None = None
        external = os.environ.get("HANDOFF_BOOTSTRAP")
        if external and (
            external.startswith("etcd://") or not external.rstrip("/").endswith(f":{int(port)}")
        ):
            log.info("handoff: using the bootstrap server at %s", external)
            return
        listen = f"tcp://{_host_port(host or '0.0.0.0', int(port))}"
        self.server = handoff.bootstrap_server(
            listen, secret_file=os.environ.get("HANDOFF_SECRET_FILE"), insecure=_insecure()
        )
        log.info("handoff: bootstrap server on %s", self.server.address)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


# --------------------------------------------------------------------------- manager


@dataclass
class _PrefillInfo:
    """What SGLang's decode reads from ``kv_manager.prefill_info_table`` to pick the
    prefill DP rank without asking a bootstrap server."""

    dp_size: int = 1
    follow_bootstrap_room: bool = True


class _EveryPrefill(dict):
    """Every prefill address is known (handoff resolves it), with one DP rank."""

    def get(self, key: Any, default: Any = None) -> _PrefillInfo:
        return _PrefillInfo()

    def __contains__(self, key: object) -> bool:
        return True


def _unsupported(what: str) -> handoff.LayoutUnsupported:
    return handoff.LayoutUnsupported(f"the handoff SGLang backend does not support {what} yet")


def _kv_ranges(args: KVArgs, is_mla: bool) -> tuple[list[handoff.KvRange], int, int]:
    """Ranges of SGLang's KV buffers in layer order (K0, V0, K1, V1, ... or one latent
    buffer per layer), the number of pages, and the number of layers."""
    ptrs = [int(p) for p in args.kv_data_ptrs]
    lens = [int(n) for n in args.kv_data_lens]
    items = [int(n) for n in args.kv_item_lens]
    if not ptrs or not (len(ptrs) == len(lens) == len(items)):
        raise handoff.LayoutError(
            f"KVArgs: {len(ptrs)} pointers, {len(lens)} lengths, {len(items)} item lengths"
        )
    if getattr(args, "num_draft_entries", 0):
        raise _unsupported("speculative decoding's draft KV")
    pages = {n // i for n, i in zip(lens, items) if i > 0}
    if len(pages) != 1 or 0 in pages or any(i <= 0 for i in items):
        raise handoff.LayoutError(
            f"KVArgs: buffers of {lens} bytes do not all hold the same number of pages "
            f"of {items} bytes"
        )
    order = list(range(len(ptrs)))
    layers = len(ptrs)
    if not is_mla:
        if len(ptrs) % 2:
            raise handoff.LayoutError(
                f"KVArgs: {len(ptrs)} buffers, expected one K and one V per layer"
            )
        layers = len(ptrs) // 2
        order = [i for layer in range(layers) for i in (layer, layers + layer)]
    ranges = [handoff.KvRange(ptrs[i], items[i], items[i]) for i in order]
    return ranges, pages.pop(), layers


def _aux_rows(args: KVArgs) -> list[tuple[int, int]]:
    """``(pointer, item bytes)`` of each aux (metadata) buffer: one row per request."""
    ptrs = [int(p) for p in args.aux_data_ptrs]
    items = [int(n) for n in args.aux_item_lens]
    if len(ptrs) != len(items):
        raise handoff.LayoutError(
            f"KVArgs: {len(ptrs)} aux pointers and {len(items)} aux item lengths"
        )
    return list(zip(ptrs, items))


class HandoffKVManager(BaseKVManager):
    """One scheduler process's handoff runtime: registers the KV pool and the aux rows,
    and routes the runtime's events to the requests' senders and receivers."""

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
        **_: Any,
    ):
        self.kv_args = args
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.role = (
            "prefill" if str(getattr(disaggregation_mode, "value", "")) == "prefill" else "decode"
        )
        # What SGLang's schedulers read from a manager; this backend keeps every one of
        # these features off.
        self.prefill_info_table = _EveryPrefill()
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.enable_all_cp_ranks_for_transfer = False
        self.is_dummy_cp_rank = False
        self.deferred_bootstrap = None
        self.kv_shard_size = 1
        self.enable_deferred_decode_kv_release = False
        self.should_verify_kv_checksum = False
        self.supports_host_destination = False
        self._dcp_pack_max_tokens = None

        if getattr(args, "state_types", None):
            raise _unsupported(f"state buffers of hybrid models ({args.state_types})")
        if int(getattr(server_args, "dp_size", 1) or 1) > 1:
            raise _unsupported("data-parallel attention (dp_size > 1)")
        if os.environ.get("SGLANG_MOONCAKE_CUSTOM_MEM_POOL") == "INTRA_NODE_NVLINK":
            raise _unsupported("aux rows in GPU memory (SGLANG_MOONCAKE_CUSTOM_MEM_POOL)")
        ranges, pages, layers = _kv_ranges(args, self.is_mla_backend)
        self.aux_rows = _aux_rows(args)
        self.page_bytes = sum(r.bytes for r in ranges)
        self.tp_rank = int(args.engine_rank)
        self.tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.pp_size = int(getattr(server_args, "pp_size", 1) or 1)
        first_layer = int(getattr(args, "prefill_start_layer", 0) or 0)
        if self.role == "decode":
            first_layer = 0
        total_layers = int(getattr(args, "total_kv_layers", 0) or 0)
        if total_layers < first_layer + layers:
            total_layers = first_layer + layers if self.pp_size == 1 else 0
        if total_layers == 0:
            total_layers = _model_layers(server_args, first_layer + layers)

        host = os.environ.get("SGLANG_HOST_IP") or getattr(server_args, "host", None)
        port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998))
        bootstrap = os.environ.get("HANDOFF_BOOTSTRAP")
        if not bootstrap:
            if self.role == "decode":
                raise handoff.InvalidConfig(
                    "the handoff SGLang backend needs HANDOFF_BOOTSTRAP=tcp://HOST:PORT on "
                    "decode: the bootstrap server (a prefill server runs one on its "
                    "--disaggregation-bootstrap-port)"
                )
            bootstrap = f"tcp://{_host_port(_connect_host(host), port)}"
        self.engine_id = os.environ.get("HANDOFF_ENGINE_ID") or (
            _host_port(_connect_host(host), port)
            if self.role == "prefill"
            else f"sglang-decode-{_host_port(_connect_host(host), int(server_args.port))}"
        )
        decode = self.role == "decode"
        ttl_s = _env_float("HANDOFF_TTL_S", 120.0)
        bootstrap_s = _env_float(
            "HANDOFF_BOOTSTRAP_TIMEOUT_S",
            _env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0),
        )
        waiting_s = _env_float(
            "HANDOFF_WAITING_TIMEOUT_S",
            _env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0),
        )
        self.send_delay_s = _env_float("HANDOFF_SEND_DELAY_MS", 0.0) / 1000.0
        self.load_wait = LoadWait(
            _env_float("HANDOFF_LOAD_WAIT_MS", 2.0), _env_float("HANDOFF_LOAD_WAIT_MS_PER_MIB", 1.0)
        )
        # Reentrant: a request may conclude (and forget itself) from an event in pump().
        self.lock = threading.RLock()
        self.requests: dict[str, HandoffKVSender | HandoffKVReceiver] = {}
        handoff.init_logging(
            os.environ.get("HANDOFF_LOG", "warn"),
            json=os.environ.get("HANDOFF_LOG_FORMAT", "text") == "json",
        )
        self.runtime = handoff.Runtime(
            role=self.role,
            engine=self.engine_id,
            bootstrap=bootstrap,
            kv_caches=ranges,
            num_blocks=pages,
            device=_device(args),
            layers=(first_layer, layers, total_layers),
            block_tokens=int(args.page_size),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            transport=os.environ.get("HANDOFF_TRANSPORT", "auto"),
            mode=os.environ.get("HANDOFF_MODE", "pull"),
            control_listen=os.environ.get("HANDOFF_CONTROL_LISTEN", "tcp://127.0.0.1:0"),
            data_listen=os.environ.get("HANDOFF_DATA_LISTEN", "127.0.0.1:0"),
            advertise_host=os.environ.get("HANDOFF_ADVERTISE_HOST"),
            timeouts={
                "bootstrap_s": bootstrap_s,
                "waiting_s": waiting_s,
                "transfer_s": _env_float("HANDOFF_TRANSFER_TIMEOUT_S", 60.0),
                "pull_ttl_s": ttl_s,
            },
            heartbeat_ms=_env_int("HANDOFF_HEARTBEAT_MS", 1000) or 1000,
            heartbeats_missed=_env_int("HANDOFF_HEARTBEATS_MISSED", 3) or 3,
            secret_file=os.environ.get("HANDOFF_SECRET_FILE"),
            admission=_env_int("HANDOFF_ADMISSION", None) if decode else None,
            insecure=_insecure(),
            thread_nice=_thread_nice(),
            tcp_busy_poll_us=_env_int("HANDOFF_TCP_BUSY_POLL_US", None),
        )
        log.info(
            "handoff %s %s rank tp%d/pp%d: %d KV ranges (layers %d..%d of %d), %d pages of "
            "%d tokens, %d aux buffers, over %s; bootstrap %s",
            self.role,
            self.engine_id,
            self.tp_rank,
            self.pp_rank,
            len(ranges),
            first_layer,
            first_layer + layers,
            total_layers,
            pages,
            int(args.page_size),
            len(self.aux_rows),
            self.runtime.transport,
            bootstrap,
        )

    def register_to_bootstrap(self) -> None:
        """Registered when the runtime started."""

    # --- events ---------------------------------------------------------------------

    def track(self, request: HandoffKVSender | HandoffKVReceiver) -> None:
        with self.lock:
            self.requests[request.request_id] = request

    def forget(self, request_id: str) -> None:
        with self.lock:
            self.requests.pop(request_id, None)

    def pump(self) -> None:
        """Hands every runtime event since the last call to its request. Never blocks."""
        events = self.runtime.drain_events()
        if not events:
            return
        with self.lock:
            for event in events:
                request = self.requests.get(event.request_id)
                if request is not None:
                    request.on_event(event)

    # --- aux rows -------------------------------------------------------------------

    def read_aux(self, index: int | None) -> bytes:
        """The request's metadata row, every aux buffer's row concatenated."""
        if index is None or index < 0:
            return b""
        return b"".join(ctypes.string_at(p + index * n, n) for p, n in self.aux_rows)

    def write_aux(self, index: int | None, payload: bytes) -> None:
        """Writes a metadata row read by `read_aux` on prefill into row ``index``."""
        want = sum(n for _, n in self.aux_rows)
        if index is None or index < 0:
            raise handoff.InvalidInput("decode gave no metadata row (aux_index)")
        if len(payload) != want:
            raise handoff.LayoutError(
                f"prefill's metadata row has {len(payload)} bytes, decode's {want}: the "
                "two servers run different models or SGLang versions"
            )
        offset = 0
        for p, n in self.aux_rows:
            ctypes.memmove(p + index * n, payload[offset : offset + n], n)
            offset += n

    def shutdown(self) -> None:
        self.runtime.shutdown()


def _device(args: KVArgs) -> str:
    gpu = getattr(args, "gpu_id", None)
    try:
        import torch

        if torch.cuda.is_available() and gpu is not None and gpu >= 0:
            return f"cuda:{int(gpu)}"
    except ImportError:
        pass
    return "cpu"


def _model_layers(server_args: Any, fallback: int) -> int:
    try:
        from sglang.srt.configs.model_config import ModelConfig

        return int(ModelConfig.from_server_args(server_args).num_hidden_layers)
    except Exception:
        return fallback


# ------------------------------------------------------------------------- requests


class _Request:
    """What senders and receivers share: a handoff handle and when its pages came back."""

    kv_mgr: HandoffKVManager
    request_id: str
    bootstrap_room: int
    handle: Any
    conclude_state: int | None
    handed: bool
    released: bool
    reason: str | None
    detail: str | None

    def _start(self, mgr: HandoffKVManager, room: Any) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = int(room) if room is not None else 0
        self.request_id = str(self.bootstrap_room)
        self.handle = None
        self.conclude_state = None
        self.handed = False
        self.released = False
        self.reason = None
        self.detail = None
        self.opened = time.monotonic()
        self.ended_at: float | None = None
        self.pages_moved = 0
        #: Ended because another rank failed the request; concluded once released.
        self.dropped = False

    def on_event(self, event: handoff.Event) -> None:
        if event.kind == "released":
            self.released = True
            if self.dropped:
                self._conclude(KVPoll.Failed)
        elif event.kind == "state" and event.state == "Failed":
            self.reason, self.detail = event.reason, event.detail

    def _fail_local(self, error: BaseException) -> int:
        """A failure before or outside handoff: nothing of ours holds the pages."""
        self.reason = getattr(error, "reason", None) or "internal"
        self.detail = str(error)
        return self._conclude(KVPoll.Failed)

    def _conclude(self, state: int) -> int:
        if self.conclude_state is None:
            self.conclude_state = state
            self.ended_at = time.monotonic()
            self.kv_mgr.forget(self.request_id)
            if state == KVPoll.Failed:
                log.warning(
                    "handoff %s request %s failed: %s (%s); pages released",
                    self.kv_mgr.role,
                    self.request_id,
                    self.reason,
                    self.detail,
                )
            else:
                log.info(
                    "handoff %s request %s done: %d pages in %.3f ms",
                    self.kv_mgr.role,
                    self.request_id,
                    self.pages_moved,
                    (self.ended_at - self.opened) * 1000.0,
                )
        return state

    def _poll_handle(self) -> int:
        """The lifecycle as KVPoll; terminal only once handoff released the pages."""
        self.kv_mgr.pump()
        state = self.handle.poll()
        if state in ("Done", "Failed"):
            if state == "Failed" and self.reason is None:
                self.reason, self.detail = self.handle.reason, self.handle.detail
            if self.released or not self.handed:
                return self._finish(state)
            return KVPoll.Transferring
        return {
            "Bootstrapping": KVPoll.Bootstrapping,
            "WaitingForInput": KVPoll.WaitingForInput,
            "Transferring": KVPoll.Transferring,
        }[state]

    def _finish(self, state: str) -> int:
        return self._conclude(KVPoll.Success if state == "Done" else KVPoll.Failed)

    def failure_exception(self) -> None:
        """Raises the named failure. SGLang also calls it on a rank whose own request has
        not failed when another rank of the request did (pipeline stages follow stage 0,
        tensor-parallel ranks the lowest poll): this rank's request is then ended too, so
        that its handle and pages go, and the exception says it came from another rank."""
        from_other_rank = self.conclude_state is None and self.reason is None
        if from_other_rank:
            self._end_for_another_rank()
        cls = handoff.error_class(self.reason or "internal")
        error = cls(
            f"handoff {self.kv_mgr.role} request {self.request_id} (bootstrap_room "
            f"{self.bootstrap_room}) failed: {self.detail or self.reason}",
            self.reason or "internal",
        )
        # SGLang logs a failure once, on the rank it started from.
        error.is_from_another_rank = from_other_rank  # type: ignore[attr-defined]
        raise error

    def _end_for_another_rank(self) -> None:
        self.reason = "aborted_by_engine"
        self.detail = "another rank of this request failed it (SGLang's consensus of ranks)"
        if self.handle is not None:
            self.handle.abort()
        if not self.handed or self.released:
            self._conclude(KVPoll.Failed)
        else:
            # The pages stay fenced until handoff releases them; poll (or
            # is_abort_release_safe) says when.
            self.dropped = True

    def clear(self) -> None:
        self.kv_mgr.forget(self.request_id)

    def get_transfer_metric(self) -> KVTransferMetric:
        # Bytes only: SGLang then times the transfer itself (last chunk queued to
        # completion), the same way for every backend that leaves the latency unset.
        return KVTransferMetric(transfer_total_bytes=self.pages_moved * self.kv_mgr.page_bytes)


class HandoffKVSender(_Request, BaseKVSender):
    """Prefill: one request's pages (and metadata row) handed to a handoff sender."""

    #: SGLang's prefill moves page indices through pinned memory and CUDA events for
    #: backends that say so; this one takes them as host arrays.
    supports_host_tensor_indices = False

    def __init__(
        self,
        mgr: HandoffKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        dest_tp_ranks: Any = None,
        pp_rank: Any = None,
        req_has_disagg_prefill_dp_rank: bool = False,
        **_: Any,
    ):
        self._start(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.pages: list[int] = []
        self.num_kv_indices: int | None = None
        self.aux_index: int | None = None
        self.due: float | None = None
        self._early_send_wait_event = None
        self.trace_ctx = None
        mgr.track(self)
        try:
            self.handle = mgr.runtime.sender(self.request_id)
        except handoff.HandoffError as e:
            self._fail_local(e)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)

    def mark_prefill_complete(self) -> None:
        return

    def pop_decode_prefix_len(self) -> int:
        return 0

    def get_max_transfer_tokens(self) -> int | None:
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk

    def send(
        self,
        kv_indices: Any,
        state_indices: Any = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        if self.conclude_state is not None or self.handle is None or self.handed:
            return
        if state_indices and any(s is not None for s in state_indices):
            self.handle.abort()
            self._fail_local(_unsupported("state buffers of hybrid models"))
            return
        self.pages.extend(int(i) for i in _flat(kv_indices))
        if self.num_kv_indices is None or len(self.pages) < self.num_kv_indices:
            return
        if self.kv_mgr.send_delay_s > 0:
            self.due = time.monotonic() + self.kv_mgr.send_delay_s
            log.info(
                "handoff prefill request %s: %d pages computed, handed over in %.1f s "
                "(HANDOFF_SEND_DELAY_MS)",
                self.request_id,
                len(self.pages),
                self.kv_mgr.send_delay_s,
            )
            return
        self._hand_over()

    def _hand_over(self) -> None:
        self.due = None
        last_stage = self.kv_mgr.pp_rank == self.kv_mgr.pp_size - 1
        aux = self.kv_mgr.read_aux(self.aux_index) if last_stage else b""
        try:
            self.handle.send(self.pages, aux=aux)
            self.handed = True
            self.pages_moved = len(self.pages)
        except handoff.HandoffError as e:
            # The request ended here already (decode gave up, or was lost): the pages
            # stay SGLang's.
            log.warning("handoff prefill request %s: pages not handed over: %s", self.request_id, e)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.due is not None and time.monotonic() >= self.due:
            self._hand_over()
        return self._poll_handle()

    def poll_pp_consensus(self) -> int:
        return self.poll()

    def abort(self) -> None:
        if self.handle is not None and self.conclude_state is None:
            self.handle.abort()


class HandoffKVReceiver(_Request, BaseKVReceiver):
    """Decode: one request's pages filled by a handoff receiver."""

    require_staging = False
    supports_host_destination = False

    def __init__(
        self,
        mgr: HandoffKVManager,
        bootstrap_addr: str,
        bootstrap_room: int | None = None,
        **_: Any,
    ):
        self._start(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.aux_index: int | None = None
        self.abort_notified = False
        self.bootstrap_infos: list[Any] = []
        #: Whether a poll waited for this request's read already (`_wait_for_read`).
        self.waited = False

    def init(self, prefill_dp_rank: int) -> None:
        if self.handle is not None or self.conclude_state is not None:
            return
        self.kv_mgr.track(self)
        try:
            self.handle = self.kv_mgr.runtime.receiver(
                self.request_id, self.bootstrap_addr, dp_rank=int(prefill_dp_rank or 0)
            )
        except handoff.HandoffError as e:
            self._fail_local(e)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        **_: Any,
    ) -> None:
        if self.conclude_state is not None or self.handle is None:
            return
        if state_indices and any(s is not None for s in state_indices):
            self.handle.abort()
            self._fail_local(_unsupported("state buffers of hybrid models"))
            return
        if decode_prefix_len:
            self.handle.abort()
            self._fail_local(_unsupported("a decode-side prefix cache (decode_prefix_len)"))
            return
        self.aux_index = None if aux_index is None else int(aux_index)
        pages = [int(i) for i in _flat(kv_indices)]
        try:
            self.handle.allocate(pages)
            self.handed = True
            self.pages_moved = len(pages)
        except handoff.HandoffError as e:
            self.handle.abort()
            self._fail_local(e)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.handle is None:
            return KVPoll.Bootstrapping
        state = self._poll_handle()
        if state == KVPoll.Bootstrapping:
            # Decode's handshake is opening the receiver: SGLang allocates the pages
            # once it sees WaitingForInput; handoff finds prefill meanwhile.
            return KVPoll.WaitingForInput
        if state == KVPoll.Transferring and self.handed and not self.waited:
            self.waited = True
            state = self._wait_for_read()
        return state

    def _wait_for_read(self) -> int:
        """Once per request: waits (GIL released) for a read under way, up to
        ``HANDOFF_LOAD_WAIT_MS`` and ``HANDOFF_LOAD_WAIT_MS_PER_MIB`` for its bytes."""
        budget = self.kv_mgr.load_wait.seconds(self.pages_moved * self.kv_mgr.page_bytes)
        if budget <= 0:
            return KVPoll.Transferring
        # Still under way after it, or failed: the next polls say.
        with contextlib.suppress(handoff.HandoffError):
            self.handle.wait(budget)
        return self._poll_handle()

    def _finish(self, state: str) -> int:
        if state == "Done":
            try:
                self._write_aux()
            except handoff.HandoffError as e:
                return self._fail_local(e)
        return super()._finish(state)

    def _write_aux(self) -> None:
        rows = self.handle.aux
        if not rows:
            raise handoff.ProtocolError(
                f"request {self.request_id}: prefill sent its KV without the metadata row"
            )
        self.kv_mgr.write_aux(self.aux_index, rows[0][1])

    def abort(self) -> None:
        if self.handle is not None and self.conclude_state is None:
            self.handle.abort()
            self.abort_notified = True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        self.abort()

    def is_abort_release_safe(self) -> bool:
        """Pages may be reused once handoff released them (or never had them)."""
        if self.handle is None or not self.handed:
            return True
        self.kv_mgr.pump()
        return self.released


def _flat(indices: Any) -> list[int]:
    if hasattr(indices, "tolist"):
        indices = indices.tolist()
    out: list[int] = []
    for i in indices:
        if isinstance(i, (list, tuple)):
            out.extend(int(x) for x in i)
        else:
            out.append(int(i))
    return out
