"""Configuration of one prefill worker process. CLI flags and environment variables fill it at
the entry point (`kvrelay serve prefill`); nothing writes to it afterwards."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from services.model.config import DTYPES
from services.offload.store import OffloadStoreConfig, OnFull
from services.rpc.server import ServerConfig
from services.transfer import PairGroupConfig

DEFAULT_PORT = 50062
DEFAULT_POLICY_ADDRESS = "127.0.0.1:50061"
# Worker ids name pair groups (no '/') and are stored by the policy service (printable ASCII).
_WORKER_ID = re.compile(r"[!-.0-~]{1,128}")
_DTYPE_ALIASES = ("fp32", "bf16", "fp16", "half")
_ADDRESS = re.compile(r"[^\s/]+:\d{1,5}")
GIB = 1024**3


@dataclass(frozen=True)
class OffloadConfig:
    """The offload tier of `recallable_remote` requests.

    Their omitted rows stay in host memory bounded by `capacity_bytes` (0: no store, and
    recallable_remote manifests are refused). Each request's rows are held for `lease_s`
    unless the decode worker renews them; `on_full` is `refuse` (a request that does not fit
    degrades to irrecoverable; rows already promised stay) or `evict_lru` (older requests
    lose their rows instead). Every `sweep_interval_s` expired leases are dropped, and so are
    the rows of requests the policy service has ended or fenced out. A recall's rows must be
    out within `recall_send_timeout_s` (and the caller's deadline). Decode workers call
    Recall at `advertise_address` (default: the transfer host and the gRPC port).
    """

    capacity_bytes: int = GIB
    lease_s: float = 30.0
    on_full: str = OnFull.REFUSE.value
    sweep_interval_s: float = 5.0
    recall_send_timeout_s: float = 10.0
    advertise_address: str = ""

    def __post_init__(self) -> None:
        _non_negative_int("offload.capacity_bytes", self.capacity_bytes)
        for name in ("lease_s", "sweep_interval_s", "recall_send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"offload.{name}: must be > 0, got {getattr(self, name)!r}")
        if self.on_full not in {m.value for m in OnFull}:
            raise ValueError(f"offload.on_full: {self.on_full!r} is not one of {[m.value for m in OnFull]}")
        if self.advertise_address and not _ADDRESS.fullmatch(self.advertise_address):
            raise ValueError(f"offload.advertise_address: {self.advertise_address!r} is not host:port")

    def store(self) -> OffloadStoreConfig | None:
        """The store's configuration, or None without a store (`capacity_bytes` 0)."""
        if self.capacity_bytes == 0:
            return None
        return OffloadStoreConfig(self.capacity_bytes, self.lease_s, OnFull(self.on_full))


@dataclass(frozen=True)
class PrefillWorkerConfig:
    """One prefill worker: the checkpoint it serves, where it listens, whom it calls, how much
    it runs at once.

    `max_in_flight` prompts run the pipeline at the same time and up to `max_queued` more
    wait for a slot; a call beyond that is refused with RESOURCE_EXHAUSTED. `accept_timeout_s`
    bounds each control call to a decode worker, `transfer_timeout_s` the whole send stage
    (rendezvous, AcceptTransfer, every layer) — both also never outlive the caller's deadline.
    `max_prompt_tokens` 0 means the model's `max_position_embeddings`.
    """

    checkpoint: Path
    worker_id: str = "prefill-0"
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    policy_address: str = DEFAULT_POLICY_ADDRESS
    # The policy service replicas' framed Session listeners (`--policy-session-address`,
    # `services.policy.framed`): the per-request calls without gRPC. Empty: over gRPC.
    policy_session_address: str = ""
    policy_timeout_s: float = 5.0
    device: str = "cpu"
    dtype: str | None = None
    chunk_size: int = 512
    max_prompt_tokens: int = 0
    max_in_flight: int = 1
    max_queued: int = 16
    accept_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    manifest_cache_size: int = 64
    pair_groups: PairGroupConfig = field(default_factory=PairGroupConfig)
    torch_threads: int = 0
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", Path(self.checkpoint))
        if not _WORKER_ID.fullmatch(self.worker_id):
            raise ValueError(
                f"worker_id: {self.worker_id!r} must be 1-128 printable ASCII characters without '/' or spaces"
            )
        if not self.policy_address or ":" not in self.policy_address:
            raise ValueError(f"policy_address: {self.policy_address!r} is not host:port")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device: {self.device!r} is not cpu, cuda or cuda:N")
        if self.dtype is not None and self.dtype not in (*DTYPES, *_DTYPE_ALIASES):
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join((*DTYPES, *_DTYPE_ALIASES))}")
        for name in ("chunk_size", "max_in_flight", "manifest_cache_size"):
            _positive_int(name, getattr(self, name))
        for name in ("max_prompt_tokens", "max_queued", "torch_threads"):
            _non_negative_int(name, getattr(self, name))
        for name in ("policy_timeout_s", "accept_timeout_s", "transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if self.pair_groups.max_groups < self.max_in_flight:
            # Every prompt in flight may hold a pair group until its send finishes.
            raise ValueError(
                f"pair_groups.max_groups: {self.pair_groups.max_groups} is below max_in_flight {self.max_in_flight}"
            )
        if self.accept_timeout_s > self.transfer_timeout_s:
            raise ValueError(
                f"accept_timeout_s: {self.accept_timeout_s} exceeds transfer_timeout_s {self.transfer_timeout_s}"
            )


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: must be a non-negative int, got {value!r}")
