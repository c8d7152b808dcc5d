"""Configuration of one gateway process. CLI flags and environment variables fill it at the
entry point (`kvrelay serve gateway`); nothing writes to it afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.discovery import DiscoveryConfig, WorkerSource
from services.rpc.server import ServerConfig

DEFAULT_POLICY = "snapkv"


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP front (services/gateway/openai_api) in the gateway process.

    `port` 0 picks a free port (`kvrelay serve gateway --http-port 0` turns the front off
    instead). `model_name` is the id `/v1/models` lists and requests must name (default: the
    checkpoint's file or directory name). `ssl_certfile`/`ssl_keyfile` (both or neither) serve
    HTTPS through uvicorn. `request_timeout_s` bounds each request: admission wait included,
    then 504 (`DeadlineExceeded`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = ""
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    request_timeout_s: float = 600.0
    shutdown_grace_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host: must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not in [0, 65535]")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile/ssl_keyfile: give both or neither")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s: {self.request_timeout_s} must be positive")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s: {self.shutdown_grace_s} must be >= 0")


@dataclass(frozen=True)
class GatewayConfig:
    """The served checkpoint (its tokenizer, vocabulary, context length and tensor contract),
    where the policy service and the workers are, request limits and deadlines.

    `dtype` must be the K/V dtype the workers load the checkpoint with (None: the
    checkpoint's own); the default manifests are registered for that tensor contract.
    """

    checkpoint: Path
    prefill_workers: WorkerSource
    decode_workers: WorkerSource
    policy_address: str = "127.0.0.1:50061"
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50051))
    dtype: str | None = None
    default_policy: str = DEFAULT_POLICY
    register_default_manifests: bool = True
    default_max_tokens: int = 64
    max_tokens_limit: int = 4096
    # None: the model's context length minus one (room for at least one output token).
    max_prompt_tokens: int | None = None
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    # The policy service replicas' framed Session listeners (`--policy-session-address`,
    # `services.policy.framed`): the per-request calls without gRPC. Empty: over gRPC.
    policy_session_address: str = ""
    policy_timeout_s: float = 5.0
    startup_timeout_s: float = 30.0
    manifest_cache_ttl_s: float = 5.0
    prefill_timeout_s: float = 120.0
    # Until the decode worker's first event (verification happens before it) and between events
    # (a request may wait for a batch slot there between its first and second token).
    first_event_timeout_s: float = 60.0
    event_timeout_s: float = 60.0
    # Attempts after the first when a worker fails before the first token reaches the client.
    max_retries: int = 1
    # Requests each prefill worker has outstanding from this gateway (within its default 1 in
    # flight + 16 queued), and each decode worker (twice its default batch of 8, so a request
    # waits there at most about one batch between its first and second token); beyond, up to
    # `admission_max_waiting` requests wait here for up to `admission_timeout_s` (or the
    # client's deadline) before RESOURCE_EXHAUSTED.
    prefill_max_outstanding: int = 8
    decode_max_outstanding: int = 16
    admission_timeout_s: float = 120.0
    admission_max_waiting: int = 1024
    # Threads that tokenize big prompts, and how many big prompts may wait for one.
    tokenizer_threads: int = 2
    tokenizer_max_waiting: int = 16
    # The OpenAI-compatible HTTP front; None: off.
    http: HttpConfig | None = None

    def __post_init__(self) -> None:
        if not self.policy_address:
            raise ValueError("policy_address: must not be empty")
        if not self.default_policy:
            raise ValueError("default_policy: must not be empty")
        if not 0 < self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens: {self.default_max_tokens} is not in (0, max_tokens_limit="
                f"{self.max_tokens_limit}]"
            )
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens: {self.max_prompt_tokens} must be >= 1")
        for name in ("policy_timeout_s", "startup_timeout_s", "manifest_cache_ttl_s",
                     "prefill_timeout_s", "first_event_timeout_s", "event_timeout_s", "admission_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: {getattr(self, name)} must be positive")
        if not 0 <= self.max_retries <= 3:
            raise ValueError(f"max_retries: {self.max_retries} is not in [0, 3]")
        for name in ("prefill_max_outstanding", "decode_max_outstanding", "tokenizer_threads"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1")
        for name in ("admission_max_waiting", "tokenizer_max_waiting"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 0")
