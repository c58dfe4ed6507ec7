"""A vLLM KV connector that moves KV cache through handoff.

Load it with::

    --kv-transfer-config '{"kv_connector": "HandoffConnector",
                           "kv_connector_module_path": "handoff.vllm",
                           "kv_role": "kv_producer",            # or "kv_consumer"
                           "kv_connector_extra_config": {"bootstrap": "tcp://HOST:PORT"}}'

It follows NixlConnector's request flow, so a proxy written for NixlConnector works
unchanged: the prefill instance is sent the request with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``; its response carries
``kv_transfer_params`` (``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
``remote_num_tokens``, ...) which the proxy passes to the decode instance.

How vLLM's connector calls map onto handoff's lifecycle:

- Prefill, ``request_finished``: the request's computed blocks are handed to a handoff
  *sender* (opened in the worker at the next step) and vLLM is told to keep them
  (``delay_free``). They stay held until decode's transfer completes, decode fails or is
  lost, or the TTL (``ttl_s``) passes: whichever comes first, handoff releases them and
  ``get_finished`` reports the request as finished sending, so vLLM frees them.
- Decode, ``get_num_new_matched_tokens``: the prompt's tokens are loaded asynchronously;
  ``update_state_after_alloc`` hands the allocated blocks to a handoff *receiver* (opened
  in the worker at the next step). When the receiver releases them after ``Done`` the
  request is reported finished receiving; when it failed (prefill lost, timeout,
  rejection), the blocks are reported through ``get_block_ids_with_load_errors`` so vLLM
  fails the request or recomputes it (its ``kv_load_failure_policy``), never hangs. Either
  is reported once handoff released the blocks, so no late write can land in them after.
- Aborts on either side end the handoff request, which tells the other side, so both
  free their blocks.

Options (``kv_connector_extra_config``), every one optional but ``bootstrap``:

``bootstrap``
    The bootstrap server, ``tcp://HOST:PORT`` (run ``handoff bootstrap --listen ...``), or
    an etcd cluster, ``etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]``.
``transport``
    ``auto`` (UCX when libucp loads, else TCP), ``ucx`` or ``tcp``. Default ``auto``.
``mode``
    Decode: ``pull`` (decode reads prefill's blocks) or ``push`` (prefill writes into
    decode's). Default ``pull``: over a one-sided plane (UCX) a failed push request keeps
    decode's blocks fenced while a lost prefill might still write, and vLLM cannot fail a
    load while keeping its blocks, so the request would wait for the fence; in pull mode
    decode's blocks are written only by its own reads, and a failure is answered at once.
    A push over UCX with a prefill on another host (which decode cannot watch) runs as
    pull.
``ttl_s``
    Prefill: how long finished requests' blocks wait for decode (default 120).
``transfer_timeout_s``, ``bootstrap_timeout_s``, ``waiting_timeout_s``
    Lifecycle deadlines, seconds: 30; prefill ``ttl_s`` and decode 10 (decode only looks
    its prefill up and dials it); prefill 120 and decode 30.
``heartbeat_ms``, ``heartbeats_missed``
    Peer liveness on control connections (defaults 1000 and 3: a silent peer is lost
    after about 3 s; a killed one at once, by its reset connections).
``control_listen``, ``data_listen``, ``advertise_host``
    Where this worker listens (defaults ``tcp://127.0.0.1:0``, ``127.0.0.1:0``) and the
    host peers dial when listening on all interfaces.
``secret_file``
    A file holding a shared secret: every connection is then authenticated (without it,
    ``HANDOFF_SECRET_FILE`` or ``HANDOFF_SECRET`` from the environment). Needed when a
    listen, advertised or bootstrap address is not loopback.
``insecure``
    ``true`` to run without a secret on non-loopback addresses (a trusted network only).
``admission``
    Decode: refuse new transfers while this many wait for blocks.
``metrics_listen``
    ``HOST:PORT``: serve this worker's Prometheus metrics at ``http://HOST:PORT/metrics``
    (requests by outcome and reason, blocks held, transfers by transport; see ARCHITECTURE).
``thread_nice``
    The nice value of the runtime's threads (default -10, so that vLLM's busy loop does not
    keep them from a core; it takes ``CAP_SYS_NICE``, else they keep vLLM's and the runtime
    logs that once); ``null`` leaves them as they are.
``tcp_busy_poll_us``
    Over TCP, wait for bytes spinning up to this many microseconds (0 to 1000) before the
    runtime's thread sleeps, on both sides: lower one-block latency for the CPU spun, for
    servers with cores to spare; 0 never spins. Unset (the default): only a client spins,
    up to 100 µs, for the answer to a small operation, and nothing spins while idle.
``head_major``
    ``true`` (the default) asks vLLM for head-major KV blocks (``LBHNC``, as NixlConnector
    does), so that prefill and decode of different TP sizes move one piece per block and
    part; ``false`` leaves the layout to vLLM (token-major blocks then cost one piece per
    token between different TP sizes). Either way each worker describes its heads to its
    peers, read from its tensors' shapes, and decode's TP size may be a multiple or a
    divisor of prefill's.
``engine_id``
    The name this instance registers under (default: vLLM's ``kv_transfer_config.engine_id``).
``load_wait_ms``, ``load_wait_ms_per_mib``
    Decode: how long, from the start of an engine step, its end may wait for the loads that
    step started: ``load_wait_ms`` (default 2; 0: never) plus ``load_wait_ms_per_mib``
    (default 1) for each MiB they move. A load that lands within it is reported in the
    same step instead of the next one, so the request is scheduled one step sooner, and
    while the engine waits the copy has the CPU to itself (on a CPU engine the next step
    would share it); a busy step (a real forward pass) is already longer and never waits.
``log``
    The runtime's own log filter (``RUST_LOG`` syntax, to stderr; default the
    ``HANDOFF_LOG`` environment variable, else ``warn``). Every line names its request
    id; ``handoff_actors=debug`` shows each request's states with timestamps.
``log_format``
    ``text`` (default; else the ``HANDOFF_LOG_FORMAT`` environment variable) or ``json``:
    one JSON object per line, with the request's span (id, role, rank, peer).
``send_delay_ms``
    Fault injection for tests: prefill hands its blocks to handoff this long after decode
    asked for them, as a slow prefill would.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

import handoff
from handoff._kv import vllm_head_layout
from handoff._runtime import LoadWait

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: Under vLLM's own logger, so that its handlers and level apply.
log = logging.getLogger("vllm.handoff")

__all__ = ["HandoffConnector", "HandoffConnectorMetadata"]


@dataclass
class _Recv:
    """Decode: one transfer to start in the worker."""

    transfer_id: str
    prefill_engine: str
    blocks: list[int]
    #: True when nothing is to be loaded: the receiver is opened only to tell prefill to
    #: free its blocks (decode aborted the request, or computes it locally).
    abort: bool = False


@dataclass
class HandoffConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells the worker side each step."""

    #: Prefill: request id -> the blocks holding its computed KV.
    sends: dict[str, list[int]] = field(default_factory=dict)
    #: Decode: local request id -> the transfer to start.
    recvs: dict[str, _Recv] = field(default_factory=dict)


def _extra(vllm_config: VllmConfig) -> dict[str, Any]:
    config = vllm_config.kv_transfer_config
    return dict(config.kv_connector_extra_config or {}) if config else {}


def _layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.3.self_attn.attn``)."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    if not found:
        raise handoff.HandoffError(f"cannot tell the layer of KV cache {name!r}")
    return int(found[-1])


class HandoffConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector interface over a handoff runtime (see the module docs)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = _extra(vllm_config)
        if not extra.get("bootstrap"):
            raise ValueError(
                "HandoffConnector needs kv_connector_extra_config.bootstrap "
                "(tcp://HOST:PORT of a `handoff bootstrap` server, or etcd://HOST:PORT/CLUSTER)"
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(
                f"HandoffConnector moves one KV cache group; this model has {len(groups)} "
                "(hybrid attention is not supported yet)"
            )
        self._engine_id = str(extra.get("engine_id") or transfer.engine_id)
        self._is_producer = bool(transfer.is_kv_producer)
        self._block_size = int(vllm_config.cache_config.block_size)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self._engine_id, self._block_size)
            self._worker = None
        else:
            self._scheduler = None
            self._worker = _WorkerSide(vllm_config, kv_cache_config, self._engine_id, extra)

    # ------------------------------------------------------------------ scheduler side

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Asks vLLM for head-major block interiors (``LBHNC``, vLLM's HND), as
        NixlConnector does: a rank's share of the heads is then one run per block per K or
        V part, so handing over between different TP sizes moves one piece per part
        instead of one per token (and the same TP sizes move whole blocks either way).
        MLA has no heads to split: its layout is left to vLLM; so is every layout with
        ``"head_major": false`` in ``kv_connector_extra_config``."""
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        if not bool(_extra(vllm_config).get("head_major", True)):
            return None
        return "LBHNC"

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, list(block_ids))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        if len(block_ids) > 1:
            raise ValueError("HandoffConnector moves one KV cache group")
        return self._scheduler.finished(request, list(block_ids[0]) if block_ids else [])

    # --------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, HandoffConnectorMetadata)
        self._worker.start(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are whole requests, finished before the request is scheduled.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Blocks are handed over when the request finishes, not layer by layer.
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.finished(set(finished_req_ids or ()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


class _SchedulerSide:
    """Decisions in the scheduler process: which requests load, which send."""

    def __init__(self, engine_id: str, block_size: int):
        self.engine_id = engine_id
        self.block_size = block_size
        self.sends: dict[str, list[int]] = {}
        self.recvs: dict[str, _Recv] = {}

    def num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if num_computed_tokens > 0:
            # A local prefix hit: transfers move a request's blocks from its first, so
            # compute the rest here and let prefill free its copy (after_alloc).
            return 0, False
        remote_tokens = int(params.get("remote_num_tokens") or 0)
        count = min(remote_tokens, len(request.prompt_token_ids or ()))
        return (count, True) if count > 0 else (0, False)

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        transfer_id = params.get("remote_request_id")
        prefill = params.get("remote_engine_id")
        if not transfer_id or not prefill:
            log.warning(
                "request %s: kv_transfer_params without remote_request_id or "
                "remote_engine_id, nothing to load: %s",
                request.request_id,
                params,
            )
            return
        if num_external_tokens <= 0:
            self.recvs[request.request_id] = _Recv(transfer_id, prefill, [], abort=True)
            return
        groups = blocks.get_block_ids()
        wanted = math.ceil(num_external_tokens / self.block_size)
        local = list(groups[0][:wanted]) if groups else []
        remote = params.get("remote_block_ids") or []
        if remote and isinstance(remote[0], list):
            remote = remote[0]
        if len(local) != wanted or len(remote) != wanted:
            # Should not happen: vLLM allocates for the tokens we asked to load.
            log.error(
                "request %s: %d blocks allocated and %d remote for %d wanted",
                request.request_id,
                len(local),
                len(remote),
                wanted,
            )
        self.recvs[request.request_id] = _Recv(transfer_id, prefill, local)

    def build_meta(self) -> HandoffConnectorMetadata:
        meta = HandoffConnectorMetadata(sends=self.sends, recvs=self.recvs)
        self.sends, self.recvs = {}, {}
        return meta

    def finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Decode: finished before its blocks were allocated (aborted while waiting):
            # tell prefill so it frees the request's blocks now, not at its TTL.
            params["do_remote_prefill"] = False
            if params.get("remote_request_id") and params.get("remote_engine_id"):
                self.recvs[request.request_id] = _Recv(
                    params["remote_request_id"], params["remote_engine_id"], [], True
                )
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None
        computed = int(request.num_computed_tokens)
        blocks = block_ids[: math.ceil(computed / self.block_size)]
        if not blocks:
            return False, None
        self.sends[request.request_id] = blocks
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": blocks,
            "remote_num_tokens": computed,
            "remote_host": None,
            "remote_port": None,
        }


@dataclass
class _Transfer:
    """One request's handoff in the worker."""

    #: vLLM's id for the request on this instance.
    local_id: str
    handle: Any
    blocks: list[int]
    opened: float
    #: Prefill: the blocks were handed to handoff (which then owes a Released event).
    handed: bool = False
    #: The request ended in handoff (Done or Failed).
    ended: bool = False
    reason: str | None = None
    #: Handoff released the blocks.
    released: bool = False
    #: Decode: vLLM finished the request (aborted it) while it was loading.
    dropped: bool = False


class _WorkerSide:
    """The handoff runtime in the worker process: owns every transfer's handle."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        engine_id: str,
        extra: dict[str, Any],
    ):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine_id = engine_id
        self.extra = extra
        transfer = vllm_config.kv_transfer_config
        self.role = "prefill" if transfer.is_kv_producer else "decode"
        self.runtime: handoff.Runtime | None = None
        #: transfer id (the prefill request id) -> its transfer.
        self.transfers: dict[str, _Transfer] = {}
        #: Prefill, with ``send_delay_ms``: transfer id -> when to hand the blocks over.
        self.delayed: dict[str, float] = {}
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.send_delay_s = float(extra.get("send_delay_ms", 0)) / 1000.0
        self.load_wait = LoadWait(
            float(extra.get("load_wait_ms", 2.0)), float(extra.get("load_wait_ms_per_mib", 1.0))
        )
        #: Bytes of one block over every registered range (`register`).
        self.block_bytes = 0
        #: When the current engine step started (`start`).
        self.step_started = 0.0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        if not kv_caches:
            raise ValueError("HandoffConnector: no KV caches to register")
        names = sorted(kv_caches, key=_layer_index)
        tensors = [kv_caches[n] for n in names]
        block_size = int(self.vllm_config.cache_config.block_size)
        num_blocks = int(
            getattr(self.kv_cache_config, "num_blocks", 0)
            or self.vllm_config.cache_config.num_gpu_blocks
            or 0
        )
        if num_blocks <= 0:
            raise ValueError("HandoffConnector: vLLM did not say how many KV blocks it has")
        ranges = vllm_block_ranges(tensors, num_blocks)
        self.block_bytes = sum(r.bytes for r in ranges)
        first = tensors[0]
        heads = self._heads(tensors, num_blocks, block_size)
        layers_total = int(self.vllm_config.model_config.get_total_num_hidden_layers())
        first_layer = _layer_index(names[0])
        parallel = self.vllm_config.parallel_config
        x = self.extra
        device = "cpu" if first.device.type == "cpu" else f"cuda:{first.device.index or 0}"
        decode = self.role == "decode"
        handoff.init_logging(
            str(x.get("log", os.environ.get("HANDOFF_LOG", "warn"))),
            json=str(x.get("log_format", os.environ.get("HANDOFF_LOG_FORMAT", "text"))) == "json",
        )
        self.runtime = handoff.Runtime(
            role=self.role,
            engine=self.engine_id,
            bootstrap=str(x["bootstrap"]),
            kv_caches=ranges,
            num_blocks=num_blocks,
            device=device,
            layers=(first_layer, len(tensors), layers_total),
            block_tokens=block_size,
            dtype_bytes=int(first.element_size()),
            **heads,
            dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
            dp_size=int(parallel.data_parallel_size),
            tp_rank=int(get_tensor_model_parallel_rank()),
            tp_size=int(get_tensor_model_parallel_world_size()),
            pp_rank=int(get_pp_group().rank_in_group),
            pp_size=int(parallel.pipeline_parallel_size),
            transport=str(x.get("transport", "auto")),
            mode=str(x.get("mode", "pull")),
            control_listen=str(x.get("control_listen", "tcp://127.0.0.1:0")),
            data_listen=str(x.get("data_listen", "127.0.0.1:0")),
            advertise_host=x.get("advertise_host"),
            timeouts={
                # Decode asks for a request prefill already finished: the bootstrap
                # lookup and dial are all its Bootstrapping covers, and prefill's write
                # follows its transfer info at once (the wait also bounds a fence).
                "bootstrap_s": float(
                    x.get("bootstrap_timeout_s", 10.0 if decode else float(x.get("ttl_s", 120.0)))
                ),
                "waiting_s": float(x.get("waiting_timeout_s", 30.0 if decode else 120.0)),
                "transfer_s": float(x.get("transfer_timeout_s", 30.0)),
                "pull_ttl_s": float(x.get("ttl_s", 120.0)),
            },
            heartbeat_ms=int(x.get("heartbeat_ms", 1000)),
            heartbeats_missed=int(x.get("heartbeats_missed", 3)),
            secret_file=x.get("secret_file"),
            admission=x.get("admission"),
            insecure=bool(x.get("insecure", False)),
            metrics_listen=x.get("metrics_listen"),
            thread_nice=x.get("thread_nice", handoff.THREAD_NICE_DEFAULT),
            tcp_busy_poll_us=(
                None if x.get("tcp_busy_poll_us") is None else int(x["tcp_busy_poll_us"])
            ),
        )
        log.info(
            "handoff %s %s: %d KV ranges (layers %d..%d of %d), %d blocks of %d tokens",
            self.role,
            self.engine_id,
            len(ranges),
            first_layer,
            first_layer + len(tensors),
            layers_total,
            num_blocks,
            block_size,
        )

    def _heads(self, tensors: list[torch.Tensor], num_blocks: int, block_size: int) -> dict:
        """How this rank's tensors hold the model's KV heads, as `Runtime` takes it: what
        lets prefill and decode of different TP sizes pair (each decode rank takes its
        heads). Empty, with the reason logged, when the tensors do not say (then only equal
        TP sizes pair)."""
        model = self.vllm_config.model_config
        if getattr(model, "use_mla", False):
            return {"kv_heads": 1, "head_size": int(tensors[0].shape[-1]), "head_order": "latent"}
        total = int(model.get_total_num_kv_heads())
        local = int(model.get_num_kv_heads(self.vllm_config.parallel_config))
        found = vllm_head_layout(tensors, num_blocks, local, block_size)
        if isinstance(found, str):
            log.warning(
                "handoff %s: KV heads not described (%s): only a peer of the same TP size "
                "can pair with this worker",
                self.engine_id,
                found,
            )
            return {}
        return {"kv_heads": total, "head_size": found.head_size, "head_order": found.order}

    # Called once per step, before the forward pass.
    def start(self, meta: HandoffConnectorMetadata) -> None:
        if self.runtime is None:
            return
        now = time.monotonic()
        self.step_started = now
        for req_id, blocks in meta.sends.items():
            self._open_sender(req_id, blocks, now)
        for local_id, recv in meta.recvs.items():
            self._open_receiver(local_id, recv, now)
        self._send_due(now)

    def _open_sender(self, req_id: str, blocks: list[int], now: float) -> None:
        assert self.runtime is not None
        if req_id in self.transfers:
            log.error("request %s: already being sent; ignoring a second send", req_id)
            return
        try:
            sender = self.runtime.sender(req_id)
        except handoff.HandoffError as e:
            log.error("request %s: cannot open a handoff sender: %s", req_id, e)
            self.finished_sending.add(req_id)
            return
        t = _Transfer(req_id, sender, blocks, now)
        self.transfers[req_id] = t
        if self.send_delay_s > 0:
            self.delayed[req_id] = now + self.send_delay_s
        else:
            self._send(t)

    def _send(self, t: _Transfer) -> None:
        try:
            t.handle.send(t.blocks)
            t.handed = True
        except handoff.HandoffError as e:
            # The request already ended here (decode gave up, or was lost): the blocks
            # stay vLLM's, freed when the end is seen.
            log.warning("request %s: blocks not handed over: %s", t.local_id, e)
            self._settle_prefill(t)

    def _send_due(self, now: float) -> None:
        for req_id, due in list(self.delayed.items()):
            if due <= now:
                del self.delayed[req_id]
                t = self.transfers.get(req_id)
                if t is not None and not t.ended:
                    self._send(t)

    def _open_receiver(self, local_id: str, recv: _Recv, now: float) -> None:
        assert self.runtime is not None
        if recv.transfer_id in self.transfers:
            log.error(
                "request %s: transfer %s is already open here; not loading it twice",
                local_id,
                recv.transfer_id,
            )
            if not recv.abort:
                self._fail_now(local_id, recv.blocks)
            return
        try:
            receiver = self.runtime.receiver(recv.transfer_id, prefill_engine=recv.prefill_engine)
        except handoff.HandoffError as e:
            log.error("request %s: cannot open a handoff receiver: %s", local_id, e)
            if not recv.abort:
                self._fail_now(local_id, recv.blocks)
            return
        if recv.abort:
            # Nothing to load: the receiver only tells prefill to free its copy.
            receiver.abort()
            self.transfers[recv.transfer_id] = _Transfer(local_id, receiver, [], now)
            return
        t = _Transfer(local_id, receiver, recv.blocks, now)
        self.transfers[recv.transfer_id] = t
        try:
            receiver.allocate(recv.blocks)
            t.handed = True
        except handoff.HandoffError as e:
            log.error("request %s: blocks refused: %s", local_id, e)
            receiver.abort()

    def _fail_now(self, local_id: str, blocks: list[int]) -> None:
        """A load that never reached handoff: its blocks are vLLM's, failed at once."""
        self.load_errors.update(blocks)
        self.finished_recving.add(local_id)

    # Called once per step, after the forward pass.
    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.runtime is None:
            return None, None
        self._send_due(time.monotonic())
        if self.role == "decode" and finished_req_ids:
            self._drop_finished(finished_req_ids)
        if self.role == "decode":
            self._wait_for_fresh_loads()
        for event in self.runtime.drain_events():
            self._on_event(event)
        sending, recving = self.finished_sending, self.finished_recving
        self.finished_sending, self.finished_recving = set(), set()
        return (sending or None), (recving or None)

    def _wait_for_fresh_loads(self) -> None:
        """Gives the loads this step started until ``load_wait_ms`` (and
        ``load_wait_ms_per_mib`` for their bytes) after its start to land (GIL released),
        so they are reported in this step rather than the next."""
        assert self.runtime is not None
        fresh = [
            t
            for t in self.transfers.values()
            if t.blocks and t.handed and not t.ended and t.opened >= self.step_started
        ]
        if not fresh:
            return
        budget = self.load_wait.seconds(sum(len(t.blocks) for t in fresh) * self.block_bytes)
        left = budget - (time.monotonic() - self.step_started)
        if left <= 0:
            return
        # Still loading after it (reported at a later step), or failed: the events say.
        with contextlib.suppress(handoff.HandoffError):
            self.runtime.wait([t.handle for t in fresh], left)

    def _on_event(self, event: Any) -> None:
        t = self.transfers.get(event.request_id)
        if t is None:
            return
        if event.kind == "state":
            if event.state == "Failed":
                t.ended, t.reason = True, str(event.reason)
                log.warning(
                    "handoff %s request %s failed: %s", self.role, event.request_id, t.reason
                )
            elif event.state == "Done":
                t.ended = True
            elif self.role == "prefill" and event.state in ("WaitingForInput", "Transferring"):
                log.info("handoff prefill request %s: decode is ready", event.request_id)
        elif event.kind == "released":
            t.released = True
        if self.role == "prefill":
            self._settle_prefill(t)
        else:
            self._settle_decode(event.request_id, t)

    def _settle_prefill(self, t: _Transfer) -> None:
        """vLLM frees a sent request's blocks once handoff no longer holds them."""
        if not (t.released or (t.ended and not t.handed)):
            return
        self.transfers.pop(t.local_id, None)
        self.delayed.pop(t.local_id, None)
        self.finished_sending.add(t.local_id)
        outcome = "sent" if t.reason is None else f"failed: {t.reason}"
        log.info(
            "handoff prefill request %s released %d blocks (%s)",
            t.local_id,
            len(t.blocks),
            outcome,
        )

    def _drop_finished(self, finished_req_ids: set[str]) -> None:
        """vLLM finished (aborted) requests still loading: end their transfers, so that
        prefill frees its copy now; their blocks return to vLLM when handoff releases them.
        """
        for t in self.transfers.values():
            if t.local_id in finished_req_ids and not t.ended and not t.dropped:
                t.dropped = True
                t.handle.abort()

    def _settle_decode(self, transfer_id: str, t: _Transfer) -> None:
        """A load is reported once handoff released its blocks, never before: after a
        failure a one-sided write may still be fenced, and vLLM reuses the blocks as soon as
        it hears (it frees or recomputes them, by its ``kv_load_failure_policy``)."""
        if not t.blocks:  # an abort-only receiver
            if t.ended:
                self.transfers.pop(transfer_id, None)
            return
        if not (t.released or (t.ended and not t.handed)):
            return
        self.transfers.pop(transfer_id, None)
        elapsed_ms = (time.monotonic() - t.opened) * 1000.0
        self.finished_recving.add(t.local_id)
        if t.reason is None:
            log.info(
                "handoff decode request %s: %d blocks in %.3f ms",
                transfer_id,
                len(t.blocks),
                elapsed_ms,
            )
            return
        self.load_errors.update(t.blocks)
        log.warning(
            "handoff decode request %s: load failed after %.1f ms (%s); %d blocks reported",
            transfer_id,
            elapsed_ms,
            t.reason,
            len(t.blocks),
        )

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.runtime is not None:
            self.runtime.shutdown()
            self.runtime = None


def vllm_block_ranges(tensors: list[torch.Tensor], num_blocks: int) -> list[handoff.KvRange]:
    """The KV ranges of vLLM's per-layer KV cache tensors, in layer order.

    vLLM allocates one tensor per layer. Its first dimension is either the block (the CPU
    backend's ``[num_blocks, kv_heads, block_size, 2 * head_size]``, FlashInfer-style
    ``[num_blocks, 2, ...]``: a block's K and V together, one range per layer) or K/V
    (FlashAttention-style ``[2, num_blocks, ...]``: two ranges per layer, K then V). A
    backend whose kernel blocks are smaller than the scheduler's keeps one scheduler block
    as ``ratio`` consecutive kernel blocks, which stay one range entry of ``ratio`` times
    the bytes. A block's bytes must be contiguous within its range; any other layout is
    refused by name.
    """
    ranges: list[handoff.KvRange] = []
    for t in tensors:
        ranges.extend(_tensor_ranges(t, num_blocks))
    return ranges


def _tensor_ranges(t: torch.Tensor, num_blocks: int) -> list[handoff.KvRange]:
    shape = tuple(int(d) for d in t.shape)
    size = int(t.element_size())
    split_kv = len(shape) >= 4 and shape[0] == 2 and shape[1] % num_blocks == 0
    planes = [t[0], t[1]] if split_kv else [t]
    out = []
    for plane in planes:
        pshape = tuple(int(d) for d in plane.shape)
        if not pshape or pshape[0] % num_blocks != 0:
            raise ValueError(
                f"KV cache tensor of shape {shape}: cannot find {num_blocks} blocks in it"
            )
        ratio = pshape[0] // num_blocks
        inner = math.prod(pshape[1:])
        if int(plane.stride(0)) < inner or (inner > 1 and not plane[0].is_contiguous()):
            raise ValueError(
                f"KV cache tensor of shape {shape} with strides {tuple(t.stride())}: "
                "a block's bytes are not contiguous (ask for an NHD/HND layout with "
                "contiguous blocks)"
            )
        stride = int(plane.stride(0)) * size
        if ratio > 1 and stride != inner * size:
            raise ValueError(
                f"KV cache tensor of shape {shape}: kernel blocks of a block are not adjacent"
            )
        out.append(handoff.KvRange(int(plane.data_ptr()), stride * ratio, inner * size * ratio))
    return out
