"""handoff: KV-cache handoff between prefill and decode workers of LLM serving.

A Python front end to the handoff runtime (Rust): a `Runtime` per worker registers the
engine's KV cache by address, opens sender (prefill) and receiver (decode) requests, and
reports their lifecycle without blocking. See README.md beside this package.
"""

from __future__ import annotations

from . import _native
from ._errors import *  # noqa: F403
from ._errors import __all__ as _error_names
from ._kv import KvRange, KvSpec, kv_spec, sglang_kv_caches, vllm_kv_caches
from ._runtime import (
    THREAD_NICE_DEFAULT,
    TIMEOUTS_DEFAULT,
    BootstrapServer,
    Event,
    ReceiverHandle,
    Runtime,
    SenderHandle,
    bootstrap_server,
)

__version__ = _native.__version__


def init_logging(level: str = "warn", json: bool = False) -> bool:
    """Logs the runtime to stderr at ``level`` (``RUST_LOG`` syntax; ``"handoff=debug"``
    follows every request), as text or, with ``json``, one JSON object per line carrying the
    request's span (id, role, rank, peer). Call once, first."""
    return _native.init_logging(level, bool(json))


__all__ = [
    "THREAD_NICE_DEFAULT",
    "TIMEOUTS_DEFAULT",
    "BootstrapServer",
    "Event",
    "KvRange",
    "KvSpec",
    "ReceiverHandle",
    "Runtime",
    "SenderHandle",
    "bootstrap_server",
    "init_logging",
    "kv_spec",
    "sglang_kv_caches",
    "vllm_kv_caches",
    *_error_names,
]
