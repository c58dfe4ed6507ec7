"""Type stubs of the native extension (`python/src/lib.rs`). Use the `handoff` package's
wrappers (`handoff.Runtime`, `handoff.bootstrap_server`); the handles are these classes."""

from collections.abc import Iterable
from typing import Literal

__version__: str
THREAD_NICE_DEFAULT: int
REQUEST_ID_BYTES_MAX: int
ENGINE_ID_BYTES_MAX: int
AUX_BYTES_MAX: int

StateName = Literal["Bootstrapping", "WaitingForInput", "Transferring", "Done", "Failed"]
EventTuple = tuple[str, str, str | None, str | None, list[int], str | None, str | None, str | None]

class SenderHandle:
    """The engine's handle on one prefill request."""

    @property
    def id(self) -> str: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def detail(self) -> str | None: ...
    def send(self, blocks: Iterable[int], aux: bytes | None = None) -> None: ...
    def poll(self) -> StateName: ...
    def abort(self) -> None: ...
    def wait(self, timeout_s: float) -> Literal["Done"]: ...

class ReceiverHandle:
    """The engine's handle on one decode request."""

    @property
    def id(self) -> str: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def detail(self) -> str | None: ...
    def allocate(self, blocks: Iterable[int]) -> None: ...
    @property
    def aux(self) -> list[tuple[str, bytes]]: ...
    def reject_busy(self) -> None: ...
    def poll(self) -> StateName: ...
    def abort(self) -> None: ...
    def wait(self, timeout_s: float) -> Literal["Done"]: ...

class Runtime:
    def __init__(
        self,
        role: str,
        engine: str,
        bootstrap: str,
        ranges: list[tuple[int, int, int]],
        num_blocks: int,
        *,
        device: str = "cpu",
        layers: tuple[int, int, int] | None = None,
        block_tokens: int = 0,
        dtype_bytes: int = 0,
        kv_heads: int = 0,
        head_order: str = "hnd",
        head_bytes: int = 0,
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
        bootstrap_s: float = 300.0,
        waiting_s: float = 300.0,
        transfer_s: float = 60.0,
        pull_ttl_s: float = 480.0,
        register_timeout_s: float = 30.0,
        heartbeat_ms: int = 5000,
        heartbeats_missed: int = 6,
        secret_file: str | None = None,
        admission: int | None = None,
        keep: object | None = None,
        insecure: bool = False,
        metrics_listen: str | None = None,
        thread_nice: int | None = ...,
        tcp_busy_poll_us: int | None = None,
    ) -> None: ...
    @property
    def metrics_address(self) -> str | None: ...
    def metrics_text(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def rank(self) -> str: ...
    @property
    def control_address(self) -> str: ...
    @property
    def data_address(self) -> str: ...
    @property
    def transport(self) -> str: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def superseded(self) -> str | None: ...
    @property
    def running(self) -> bool: ...
    def sender(self, id: str) -> SenderHandle: ...
    def receiver(
        self,
        id: str,
        prefill_engine: str,
        dp_rank: int | None = None,
        blocks: Iterable[int] | None = None,
    ) -> ReceiverHandle: ...
    def drain_events(self) -> list[EventTuple]: ...
    def open_requests(self) -> int: ...
    def wait(
        self, handles: Iterable[SenderHandle | ReceiverHandle], timeout_s: float
    ) -> list[tuple[str, str]]: ...
    def shutdown(self, timeout_s: float = 10.0) -> bool: ...

class BootstrapServer:
    def __init__(
        self,
        listen: str = "tcp://127.0.0.1:0",
        *,
        secret_file: str | None = None,
        expire_after_s: float | None = None,
        insecure: bool = False,
    ) -> None: ...
    @property
    def address(self) -> str: ...
    def stop(self) -> None: ...

def init_logging(level: str = "warn", json: bool = False) -> bool: ...
