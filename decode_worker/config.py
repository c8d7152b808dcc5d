"""Configuration of one decode worker process. CLI flags and environment variables fill it at
the entry point (`kvrelay serve decode`); nothing writes to it afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.rpc.server import ServerConfig
from services.transfer import PairGroupConfig

DEVICE_TYPES = ("cpu", "cuda")
GIB = 1024**3


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: at most `max_batch` requests per decode step, and at most
    `kv_budget_bytes` of KV reserved by accepted transfers (see `scheduler.reservation_bytes`):
    the decode caches' one page pool, preallocated at that size."""

    max_batch: int = 8
    kv_budget_bytes: int = 2 * GIB
    # Rows per (layer, owner) the decode cache's page tables start with; they grow by doubling.
    initial_row_capacity: int = 256
    # Rows per KV page; the pool holds kv_budget_bytes // page bytes pages.
    page_rows: int = 16
    # Decode steps of one request per `decode.step` span (bounds trace volume per token).
    trace_steps_per_span: int = 16

    def __post_init__(self) -> None:
        for name in ("max_batch", "kv_budget_bytes", "initial_row_capacity", "page_rows",
                     "trace_steps_per_span"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")


@dataclass(frozen=True)
class DecodeWorkerConfig:
    """One decode worker: where it listens (gRPC `server`, rendezvous store `transfer`), which
    checkpoint it decodes with, which policy service fences its requests, and its limits.

    `transfer_timeout_s` bounds a transfer whose descriptor carries no deadline and caps one
    that does; `lease_timeout_s` releases an accepted transfer whose stream has not opened that
    long after its view was verified (or rejected);
    `policy_timeout_s` bounds each policy service call during verification.
    """

    checkpoint: Path
    policy_address: str = "127.0.0.1:50061"
    worker_id: str = "decode-0"
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50063))
    transfer: PairGroupConfig = field(default_factory=lambda: PairGroupConfig(store_port=50064))
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    dtype: str | None = None
    max_new_tokens: int = 4096
    transfer_timeout_s: float = 60.0
    lease_timeout_s: float = 60.0
    # The policy service replicas' framed Session listeners (`--policy-session-address`,
    # `services.policy.framed`): the per-request calls without gRPC. Empty: over gRPC.
    policy_session_address: str = ""
    policy_timeout_s: float = 5.0
    receive_threads: int = 8
    manifest_cache_size: int = 64
    torch_threads: int = 0  # 0: torch's choice

    def __post_init__(self) -> None:
        if not str(self.checkpoint):
            raise ValueError("checkpoint: must not be empty")
        if not self.policy_address:
            raise ValueError("policy_address: must not be empty")
        if not self.worker_id or any(c.isspace() or c == "/" for c in self.worker_id):
            raise ValueError(f"worker_id: {self.worker_id!r} must be non-empty, without spaces or '/'")
        if self.device.split(":")[0] not in DEVICE_TYPES:
            raise ValueError(f"device: {self.device!r} is not one of {DEVICE_TYPES} (optionally cuda:N)")
        for name in ("transfer_timeout_s", "lease_timeout_s", "policy_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if isinstance(self.torch_threads, bool) or not isinstance(self.torch_threads, int) or self.torch_threads < 0:
            raise ValueError(f"torch_threads: must be an int >= 0, got {self.torch_threads!r}")
        for name in ("max_new_tokens", "receive_threads", "manifest_cache_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
