"""Exceptions: every failure is a `HandoffError` subclass carrying the named reason.

`reason` is a stable name (the lifecycle's failure kinds, e.g. ``"peer_lost"``, or the API's
own, e.g. ``"block_out_of_range"``); `detail` says what happened. The native module raises
these by reason name through `_from_native`.
"""

from __future__ import annotations


class HandoffError(Exception):
    """Base of every handoff error. `reason`: the stable reason name; `detail`: the text."""

    reason: str = "error"

    def __init__(self, detail: str = "", reason: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if reason is not None:
            self.reason = reason

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


# --- a request ended Failed(reason) -------------------------------------------------------


class RequestFailed(HandoffError):
    """A request ended `Failed`; the subclass names why."""


class Timeout(RequestFailed, TimeoutError):
    """A lifecycle deadline passed (the subclass says which)."""


class BootstrapTimeout(Timeout):
    reason = "bootstrap_timeout"


class WaitingTimeout(Timeout):
    reason = "waiting_timeout"


class TransferTimeout(Timeout):
    reason = "transfer_timeout"


class TtlExpired(Timeout):
    reason = "ttl_expired"


class BootstrapUnavailable(RequestFailed):
    reason = "bootstrap_unavailable"


class TransferFailed(RequestFailed):
    reason = "transfer_failed"


class PeerLost(RequestFailed):
    reason = "peer_lost"


class Rejected(RequestFailed):
    """Decode refused the request (saturated)."""

    reason = "rejected_busy"


class Aborted(RequestFailed):
    """The request was aborted: by this engine, or by the other side."""

    reason = "aborted_by_engine"


class AbortedByPeer(Aborted):
    reason = "aborted_by_peer"


class ProtocolError(RequestFailed):
    reason = "protocol_error"


class InternalError(RequestFailed):
    reason = "internal_error"


class Superseded(RequestFailed):
    """A newer process holds this worker's rank (the directory says so): every open request
    fails with it, and new ones are refused. Stop this process; the newer one serves."""

    reason = "superseded"


# --- the API's own errors -----------------------------------------------------------------


class WaitTimeout(HandoffError, TimeoutError):
    """A blocking call's own timeout passed; the request goes on."""

    reason = "wait_timeout"


class InvalidInput(HandoffError, ValueError, TypeError):
    """An argument of the wrong type or value (nothing was changed)."""

    reason = "invalid_argument"


class BlockOutOfRange(InvalidInput, IndexError):
    reason = "block_out_of_range"


class LayoutError(InvalidInput):
    """KV memory that cannot be registered as given (not contiguous where it must be, ...)."""

    reason = "invalid_memory"


class LayoutUnsupported(LayoutError):
    reason = "layout_unsupported"


class InvalidConfig(InvalidInput):
    reason = "invalid_config"


class WrongRole(InvalidInput):
    reason = "wrong_role"


class DuplicateRequest(InvalidInput):
    reason = "duplicate_request"


class AlreadyHandedOver(InvalidInput):
    reason = "already_handed_over"


class RequestEnded(HandoffError):
    """Blocks handed over after the request ended: they stay the caller's."""

    reason = "request_ended"


class TooManyRequests(HandoffError):
    reason = "too_many_requests"


class RuntimeStopped(HandoffError):
    reason = "runtime_stopped"


class StartError(HandoffError):
    """The runtime (or bootstrap server) could not start: the subclass says where."""

    reason = "start_failed"


class BindFailed(StartError):
    reason = "bind_failed"


class RegisterFailed(StartError):
    reason = "register_failed"


class DataPlaneError(StartError):
    reason = "data_plane"


class InsecureRefused(StartError):
    """A non-loopback address without a shared secret: set ``secret_file`` (or
    ``HANDOFF_SECRET_FILE`` / ``HANDOFF_SECRET``), or pass ``insecure=True``."""

    reason = "insecure"


_BY_REASON: dict[str, type[HandoffError]] = {}
for _cls in list(globals().values()):
    if isinstance(_cls, type) and issubclass(_cls, HandoffError) and "reason" in _cls.__dict__:
        _BY_REASON[_cls.__dict__["reason"]] = _cls


def error_class(reason: str) -> type[HandoffError]:
    """The exception class for a reason name (`HandoffError` for an unknown one)."""
    return _BY_REASON.get(reason, HandoffError)


def _from_native(reason: str, detail: str) -> HandoffError:
    return error_class(reason)(detail, reason)


__all__ = [
    name for name, v in globals().items() if isinstance(v, type) and issubclass(v, HandoffError)
]
__all__ += ["error_class"]
