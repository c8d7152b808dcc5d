"""`kvrelay serve policy|gateway|prefill|decode`: one process per service. Each command imports
its service lazily, so `kvrelay --help` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvrelay.checkpoints import DEFAULT_MODEL_HELP, served_checkpoint
from kvrelay.security_options import with_transport_security

if TYPE_CHECKING:
    from services.security.transport import TransportSecurity

serve_app = typer.Typer(no_args_is_help=True, help="Run a kvrelay service.")


@serve_app.command("policy")
@with_transport_security()
def serve_policy(
    host: str = typer.Option("127.0.0.1", envvar="KVRELAY_POLICY_HOST", help="Interface to listen on (0.0.0.0 in a pod)."),
    port: int = typer.Option(50061, envvar="KVRELAY_POLICY_PORT"),
    session_port: int = typer.Option(0, envvar="KVRELAY_POLICY_SESSION_PORT", help="Also serve the per-request calls (begin, publish, fence, end) on this port without gRPC: framed Session connections, same TLS and tokens, a fraction of a gRPC message's cost (clients: --policy-session-address). 0: off."),
    redis_url: str | None = typer.Option(None, envvar="REDIS_URL", help="redis:// or rediss:// (user:password@ for AUTH/ACL), redis+cluster:// or rediss+cluster:// for a Redis Cluster, redis+sentinel://user:pass@host:port,host:port/MASTER/DB (or rediss+sentinel://; user:pass@ and /DB optional) for the master Redis Sentinel names; unset starts an embedded redis-server."),
    redis_data_dir: Path | None = typer.Option(None, envvar="KVRELAY_REDIS_DATA_DIR", help="Embedded redis only: AOF persistence here."),
    redis_appendfsync: str = typer.Option("everysec", envvar="KVRELAY_REDIS_APPENDFSYNC", help="Embedded redis only: always | everysec | no."),
    manifest_journal: Path | None = typer.Option(None, envvar="KVRELAY_POLICY_MANIFEST_JOURNAL", help="Append every stored manifest to this file; a Redis that lost its data (or a restarted service) gets them back from it. Unset: kept in memory only."),
    redis_wait_replicas: int | None = typer.Option(None, envvar="KVRELAY_REDIS_WAIT_REPLICAS", help="Acknowledge a mutation only once this many Redis replicas have it (WAIT); default 1 where Redis has replicas, 0 otherwise."),
    redis_wait_timeout_ms: int = typer.Option(200, envvar="KVRELAY_REDIS_WAIT_TIMEOUT_MS", help="How long a mutation waits for its replicas before failing UNAVAILABLE (retryable)."),
    redis_pipelining: bool = typer.Option(True, envvar="KVRELAY_REDIS_PIPELINING", help="Send the Redis calls of concurrent requests together, as pipelines (off: one round trip each)."),
    key_prefix: str = typer.Option("kvr:", envvar="KVRELAY_POLICY_KEY_PREFIX"),
    default_lease_ms: int = typer.Option(15 * 60 * 1000, envvar="KVRELAY_POLICY_LEASE_MS", help="Request lease when a call does not give one."),
    end_retention_ms: int = typer.Option(60 * 1000, envvar="KVRELAY_POLICY_END_RETENTION_MS", help="How long an ended request stays readable."),
    max_message_bytes: int = typer.Option(8 * 1024 * 1024, envvar="KVRELAY_MAX_MESSAGE_BYTES"),
    log_level: str = typer.Option("INFO", envvar="KVRELAY_LOG_LEVEL"),
    log_format: str = typer.Option("text", envvar="KVRELAY_LOG_FORMAT", help="text, or json: one object per line with trace_id, span_id, request_id."),
    metrics_port: int = typer.Option(9092, envvar="KVRELAY_POLICY_METRICS_PORT", help="Prometheus /metrics port on --host (0: off)."),
    checkpoint: Path | None = typer.Option(None, envvar="KVRELAY_POLICY_CHECKPOINT", help="Checkpoint the workers serve (.gguf file or HF directory; its config only): manifests it cannot run are refused at registration. Unset: every valid manifest is accepted."),
    dtype: str | None = typer.Option(None, envvar="KVRELAY_DTYPE", help="With --checkpoint: the workers' K/V dtype (default: the checkpoint's)."),
    *,
    security: TransportSecurity,
) -> None:
    """Manifests and generation fences in Redis, over gRPC (health and reflection included)."""
    import asyncio

    from policy_service.config import PolicyServiceConfig, served_deployment
    from policy_service.server import serve
    from services.model.errors import ModelError
    from services.rpc.server import ServerConfig
    from services.telemetry.process import TelemetryConfig, observed

    try:
        deployments = () if checkpoint is None else (served_deployment(checkpoint, dtype),)
    except ModelError as exc:
        typer.echo(f"kvrelay serve policy: --checkpoint {checkpoint}: {exc}", err=True)
        raise typer.Exit(2) from None
    config = PolicyServiceConfig(
        server=ServerConfig(host=host, port=port, max_message_bytes=max_message_bytes, security=security),
        redis_url=redis_url,
        redis_data_dir=redis_data_dir,
        redis_appendfsync=redis_appendfsync,
        manifest_journal=manifest_journal,
        redis_wait_replicas=redis_wait_replicas,
        redis_wait_timeout_ms=redis_wait_timeout_ms,
        redis_pipelining=redis_pipelining,
        key_prefix=key_prefix,
        default_lease_ms=default_lease_ms,
        end_retention_ms=end_retention_ms,
        deployments=deployments,
        session_port=session_port or None,
    )
    telemetry = TelemetryConfig("policy", log_level, log_format, metrics_host=host, metrics_port=metrics_port)
    with observed(telemetry):
        asyncio.run(serve(config))


@serve_app.command("gateway")
@with_transport_security(gateway=True)
def serve_gateway(
    checkpoint: Path | None = typer.Option(None, envvar="KVRELAY_CHECKPOINT", help=f"Checkpoint the workers serve, .gguf file or HF directory (its tokenizer and config; {DEFAULT_MODEL_HELP})."),
    dtype: str | None = typer.Option(None, envvar="KVRELAY_DTYPE", help="The workers' K/V dtype (default: the checkpoint's); default manifests are registered for it."),
    host: str = typer.Option("127.0.0.1", envvar="KVRELAY_GATEWAY_HOST", help="Interface to listen on (0.0.0.0 in a pod)."),
    port: int = typer.Option(50051, envvar="KVRELAY_GATEWAY_PORT"),
    policy_address: str = typer.Option("127.0.0.1:50061", envvar="KVRELAY_POLICY_ADDRESS", help="host:port of the policy service; several replicas: comma-separated IP:port, or dns:///NAME:PORT (round robin)."),
    policy_session_address: str = typer.Option("", envvar="KVRELAY_POLICY_SESSION_ADDRESS", help="host:port of the policy service's framed Session listener (its --session-port; replicas comma-separated): the per-request policy calls without gRPC. Empty: over gRPC."),
    prefill_workers: str = typer.Option("127.0.0.1:50062", envvar="KVRELAY_PREFILL_WORKERS", help="host:port[,host:port...] or dns:///name:port."),
    decode_workers: str = typer.Option("127.0.0.1:50063", envvar="KVRELAY_DECODE_WORKERS", help="host:port[,host:port...] or dns:///name:port."),
    default_policy: str = typer.Option("snapkv", envvar="KVRELAY_DEFAULT_POLICY", help="Policy of requests that name none."),
    register_defaults: bool = typer.Option(True, envvar="KVRELAY_REGISTER_DEFAULT_MANIFESTS", help="Register the default manifests for the checkpoint at start-up (idempotent)."),
    default_max_tokens: int = typer.Option(64, envvar="KVRELAY_DEFAULT_MAX_TOKENS"),
    max_tokens_limit: int = typer.Option(4096, envvar="KVRELAY_MAX_TOKENS_LIMIT"),
    max_prompt_tokens: int | None = typer.Option(None, envvar="KVRELAY_MAX_PROMPT_TOKENS", help="Default: the model's context length - 1."),
    health_interval_s: float = typer.Option(2.0, envvar="KVRELAY_HEALTH_INTERVAL_S"),
    resolve_interval_s: float = typer.Option(30.0, envvar="KVRELAY_RESOLVE_INTERVAL_S", help="How often DNS worker names are re-resolved."),
    prefill_timeout_s: float = typer.Option(120.0, envvar="KVRELAY_PREFILL_TIMEOUT_S"),
    first_event_timeout_s: float = typer.Option(60.0, envvar="KVRELAY_FIRST_EVENT_TIMEOUT_S", help="Until a decode worker's first event (it verifies the transfer first)."),
    event_timeout_s: float = typer.Option(60.0, envvar="KVRELAY_EVENT_TIMEOUT_S", help="Between two events of a decode worker's stream."),
    admission_timeout_s: float = typer.Option(120.0, envvar="KVRELAY_ADMISSION_TIMEOUT_S", help="How long a request may wait for a worker with room (then RESOURCE_EXHAUSTED)."),
    prefill_max_outstanding: int = typer.Option(8, envvar="KVRELAY_PREFILL_MAX_OUTSTANDING", help="Requests each prefill worker has from this gateway at once; more wait here."),
    decode_max_outstanding: int = typer.Option(16, envvar="KVRELAY_DECODE_MAX_OUTSTANDING", help="Requests each decode worker has from this gateway at once; more wait here."),
    max_retries: int = typer.Option(1, envvar="KVRELAY_GATEWAY_MAX_RETRIES", help="Retries when a worker fails before the first token."),
    max_message_bytes: int = typer.Option(8 * 1024 * 1024, envvar="KVRELAY_MAX_MESSAGE_BYTES"),
    log_level: str = typer.Option("INFO", envvar="KVRELAY_LOG_LEVEL"),
    log_format: str = typer.Option("text", envvar="KVRELAY_LOG_FORMAT", help="text, or json: one object per line with trace_id, span_id, request_id."),
    metrics_port: int = typer.Option(9091, envvar="KVRELAY_GATEWAY_METRICS_PORT", help="Prometheus /metrics port on --host (0: off)."),
    http_port: int = typer.Option(0, envvar="KVRELAY_GATEWAY_HTTP_PORT", help="OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health) on --host (0: off)."),
    http_model_name: str = typer.Option("", envvar="KVRELAY_GATEWAY_HTTP_MODEL_NAME", help="Model id of the HTTP API (default: the checkpoint's file or directory name)."),
    http_certfile: Path | None = typer.Option(None, envvar="KVRELAY_GATEWAY_HTTP_CERTFILE", help="With --http-keyfile: serve the HTTP API over HTTPS."),
    http_keyfile: Path | None = typer.Option(None, envvar="KVRELAY_GATEWAY_HTTP_KEYFILE"),
    *,
    security: TransportSecurity,
) -> None:
    """Client-facing Generate API: validates, picks workers, orchestrates, streams tokens and a summary."""
    import asyncio

    from services.gateway import DiscoveryConfig, GatewayConfig, WorkerSource
    from services.gateway.config import HttpConfig
    from services.gateway.server import serve
    from services.rpc.server import ServerConfig
    from services.telemetry.process import TelemetryConfig, observed

    config = GatewayConfig(
        checkpoint=served_checkpoint(checkpoint),
        prefill_workers=WorkerSource.parse(prefill_workers, "prefill_workers"),
        decode_workers=WorkerSource.parse(decode_workers, "decode_workers"),
        policy_address=policy_address,
        policy_session_address=policy_session_address,
        server=ServerConfig(host=host, port=port, max_message_bytes=max_message_bytes, security=security),
        dtype=dtype,
        default_policy=default_policy,
        register_default_manifests=register_defaults,
        default_max_tokens=default_max_tokens,
        max_tokens_limit=max_tokens_limit,
        max_prompt_tokens=max_prompt_tokens,
        discovery=DiscoveryConfig(health_interval_s=health_interval_s, resolve_interval_s=resolve_interval_s),
        prefill_timeout_s=prefill_timeout_s,
        first_event_timeout_s=first_event_timeout_s,
        event_timeout_s=event_timeout_s,
        admission_timeout_s=admission_timeout_s,
        prefill_max_outstanding=prefill_max_outstanding,
        decode_max_outstanding=decode_max_outstanding,
        max_retries=max_retries,
        http=HttpConfig(host=host, port=http_port, model_name=http_model_name, ssl_certfile=http_certfile,
                        ssl_keyfile=http_keyfile) if http_port else None,
    )
    telemetry = TelemetryConfig("gateway", log_level, log_format, metrics_host=host, metrics_port=metrics_port)
    with observed(telemetry):
        asyncio.run(serve(config))


@serve_app.command("prefill")
@with_transport_security()
def serve_prefill(
    checkpoint: Path | None = typer.Option(None, envvar="KVRELAY_CHECKPOINT", help=f"Checkpoint: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    device: str = typer.Option("cpu", envvar="KVRELAY_DEVICE", help="cpu, cuda or cuda:N (CUDA tensors travel over NCCL)."),
    dtype: str | None = typer.Option(None, envvar="KVRELAY_DTYPE", help="K/V and compute dtype (default: the checkpoint's); manifests must declare the same."),
    host: str = typer.Option("127.0.0.1", envvar="KVRELAY_PREFILL_HOST", help="Interface to listen on (0.0.0.0 in a pod)."),
    port: int = typer.Option(50062, envvar="KVRELAY_PREFILL_PORT"),
    worker_id: str | None = typer.Option(None, envvar="KVRELAY_PREFILL_WORKER_ID", help="Default: prefill-<hostname>-<port>."),
    transfer_host: str | None = typer.Option(None, envvar="KVRELAY_PREFILL_TRANSFER_HOST", help="Address pair groups bind and advertise (the pod IP; default: --host, or this host's address when --host is a wildcard)."),
    policy_address: str = typer.Option("127.0.0.1:50061", envvar="KVRELAY_POLICY_ADDRESS", help="host:port of the policy service; several replicas: comma-separated IP:port, or dns:///NAME:PORT (round robin)."),
    policy_session_address: str = typer.Option("", envvar="KVRELAY_POLICY_SESSION_ADDRESS", help="host:port of the policy service's framed Session listener (its --session-port; replicas comma-separated): the per-request policy calls without gRPC. Empty: over gRPC."),
    max_in_flight: int = typer.Option(1, envvar="KVRELAY_PREFILL_MAX_IN_FLIGHT", help="Prompts in the pipeline at once."),
    max_queued: int = typer.Option(16, envvar="KVRELAY_PREFILL_MAX_QUEUED", help="Prompts waiting for a slot; beyond: RESOURCE_EXHAUSTED."),
    max_prompt_tokens: int = typer.Option(0, envvar="KVRELAY_MAX_PROMPT_TOKENS", help="0: the model's context length."),
    chunk_size: int = typer.Option(512, envvar="KVRELAY_PREFILL_CHUNK_SIZE", help="Queries per attention/MLP chunk."),
    accept_timeout_s: float = typer.Option(5.0, envvar="KVRELAY_PREFILL_ACCEPT_TIMEOUT_S", help="Each control call to a decode worker."),
    transfer_timeout_s: float = typer.Option(30.0, envvar="KVRELAY_PREFILL_TRANSFER_TIMEOUT_S", help="The whole send stage."),
    max_pair_groups: int = typer.Option(8, envvar="KVRELAY_PREFILL_MAX_PAIR_GROUPS"),
    offload_capacity_mib: float = typer.Option(1024.0, envvar="KVRELAY_PREFILL_OFFLOAD_CAPACITY_MIB", help="Host memory for omitted rows of recallable_remote requests (0: no store; such manifests are refused)."),
    offload_lease_s: float = typer.Option(30.0, envvar="KVRELAY_PREFILL_OFFLOAD_LEASE_S", help="How long offloaded rows stay without the decode worker renewing them."),
    offload_on_full: str = typer.Option("refuse", envvar="KVRELAY_PREFILL_OFFLOAD_ON_FULL", help="refuse (the new request degrades to irrecoverable) or evict_lru (older requests lose their rows)."),
    offload_sweep_s: float = typer.Option(5.0, envvar="KVRELAY_PREFILL_OFFLOAD_SWEEP_S", help="How often expired leases and ended or fenced-out requests are dropped."),
    offload_address: str | None = typer.Option(None, envvar="KVRELAY_PREFILL_OFFLOAD_ADDRESS", help="host:port decode workers call Recall at (default: the transfer host and --port)."),
    torch_threads: int = typer.Option(0, envvar="KVRELAY_TORCH_THREADS", help="0: torch's choice."),
    max_message_bytes: int = typer.Option(8 * 1024 * 1024, envvar="KVRELAY_MAX_MESSAGE_BYTES"),
    log_level: str = typer.Option("INFO", envvar="KVRELAY_LOG_LEVEL"),
    log_format: str = typer.Option("text", envvar="KVRELAY_LOG_FORMAT", help="text, or json: one object per line with trace_id, span_id, request_id."),
    metrics_port: int = typer.Option(9093, envvar="KVRELAY_PREFILL_METRICS_PORT", help="Prometheus /metrics port on --host (0: off)."),
    *,
    security: TransportSecurity,
) -> None:
    """Prefill worker: forward → score → allocate → select → pack → offload → publish → send to a decode worker."""
    import asyncio
    import socket

    from prefill_worker.config import OffloadConfig, PrefillWorkerConfig
    from prefill_worker.server import serve
    from services.rpc.server import ServerConfig
    from services.telemetry.process import TelemetryConfig, observed
    from services.transfer import PairGroupConfig

    wildcard = host in ("0.0.0.0", "::", "")
    config = PrefillWorkerConfig(
        checkpoint=served_checkpoint(checkpoint),
        worker_id=worker_id or f"prefill-{socket.gethostname()}-{port}",
        server=ServerConfig(host=host, port=port, max_message_bytes=max_message_bytes, security=security),
        policy_address=policy_address,
        policy_session_address=policy_session_address,
        device=device,
        dtype=dtype,
        chunk_size=chunk_size,
        max_prompt_tokens=max_prompt_tokens,
        max_in_flight=max_in_flight,
        max_queued=max_queued,
        accept_timeout_s=accept_timeout_s,
        transfer_timeout_s=transfer_timeout_s,
        pair_groups=PairGroupConfig(
            max_groups=max_pair_groups,
            bind_host=transfer_host or (socket.gethostbyname(socket.gethostname()) if wildcard else host),
        ),
        torch_threads=torch_threads,
        offload=OffloadConfig(
            capacity_bytes=int(offload_capacity_mib * 1024 * 1024),
            lease_s=offload_lease_s,
            on_full=offload_on_full,
            sweep_interval_s=offload_sweep_s,
            advertise_address=offload_address or "",
        ),
    )
    telemetry = TelemetryConfig("prefill", log_level, log_format, metrics_host=host, metrics_port=metrics_port)
    with observed(telemetry):
        asyncio.run(serve(config))


@serve_app.command("decode")
@with_transport_security()
def serve_decode(
    checkpoint: Path | None = typer.Option(None, envvar="KVRELAY_CHECKPOINT", help=f"Checkpoint: a .gguf file or an HF directory ({DEFAULT_MODEL_HELP})."),
    device: str = typer.Option("cpu", envvar="KVRELAY_DEVICE", help="cpu, cuda or cuda:N (CUDA tensors travel over NCCL)."),
    dtype: str | None = typer.Option(None, envvar="KVRELAY_DTYPE", help="Compute and KV cache dtype (default: the checkpoint's)."),
    host: str = typer.Option("127.0.0.1", envvar="KVRELAY_DECODE_HOST", help="Interface to listen on (0.0.0.0 in a pod)."),
    port: int = typer.Option(50063, envvar="KVRELAY_DECODE_PORT"),
    transfer_port: int = typer.Option(50064, envvar="KVRELAY_DECODE_TRANSFER_PORT", help="TCPStore rendezvous port of the pair groups."),
    transfer_host: str | None = typer.Option(None, envvar="KVRELAY_DECODE_TRANSFER_HOST", help="Address the rendezvous store and pair groups bind and advertise (the pod IP; default: --host, or this host's address when --host is a wildcard)."),
    worker_id: str | None = typer.Option(None, envvar="KVRELAY_DECODE_WORKER_ID", help="Default: decode-<hostname>-<port>."),
    policy_address: str = typer.Option("127.0.0.1:50061", envvar="KVRELAY_POLICY_ADDRESS", help="host:port of the policy service; several replicas: comma-separated IP:port, or dns:///NAME:PORT (round robin)."),
    policy_session_address: str = typer.Option("", envvar="KVRELAY_POLICY_SESSION_ADDRESS", help="host:port of the policy service's framed Session listener (its --session-port; replicas comma-separated): the per-request policy calls without gRPC. Empty: over gRPC."),
    max_batch: int = typer.Option(8, envvar="KVRELAY_DECODE_MAX_BATCH", help="Requests per batched decode step."),
    kv_budget_mib: int = typer.Option(2048, envvar="KVRELAY_DECODE_KV_BUDGET_MIB", help="The KV page pool, allocated at start-up: what accepted transfers may reserve; beyond: RESOURCE_EXHAUSTED."),
    max_new_tokens: int = typer.Option(4096, envvar="KVRELAY_MAX_TOKENS_LIMIT", help="Largest max_tokens a descriptor may ask for."),
    transfer_timeout_s: float = typer.Option(60.0, envvar="KVRELAY_DECODE_TRANSFER_TIMEOUT_S", help="Caps every transfer's deadline."),
    lease_timeout_s: float = typer.Option(60.0, envvar="KVRELAY_DECODE_LEASE_TIMEOUT_S", help="Release an accepted transfer whose stream never opens."),
    max_pair_groups: int = typer.Option(8, envvar="KVRELAY_DECODE_MAX_PAIR_GROUPS"),
    torch_threads: int = typer.Option(0, envvar="KVRELAY_TORCH_THREADS", help="0: torch's choice."),
    max_message_bytes: int = typer.Option(8 * 1024 * 1024, envvar="KVRELAY_MAX_MESSAGE_BYTES"),
    log_level: str = typer.Option("INFO", envvar="KVRELAY_LOG_LEVEL"),
    log_format: str = typer.Option("text", envvar="KVRELAY_LOG_FORMAT", help="text, or json: one object per line with trace_id, span_id, request_id."),
    metrics_port: int = typer.Option(9094, envvar="KVRELAY_DECODE_METRICS_PORT", help="Prometheus /metrics port on --host (0: off)."),
    codes_kernels: Path | None = typer.Option(None, envvar="KVRELAY_CODES_KERNELS", help="Folder of codes-ranking kernels built ahead (`kvrelay build-kernels`): the best one this CPU runs is loaded before a build is tried (the image's final stage has no compiler). Unset: built for this CPU at start-up, else torch scores."),
    *,
    security: TransportSecurity,
) -> None:
    """Decode worker: accept → receive → verify (receipt, fence) → continuous-batching decode → stream tokens."""
    import asyncio
    import socket

    from decode_worker.config import DecodeWorkerConfig, SchedulerConfig
    from decode_worker.server import serve
    from services.offload import codes_kernel
    from services.rpc.server import ServerConfig
    from services.telemetry.process import TelemetryConfig, observed
    from services.transfer import PairGroupConfig

    if codes_kernels is not None:
        codes_kernel.use_prebuilt(codes_kernels)
    wildcard = host in ("0.0.0.0", "::", "")
    config = DecodeWorkerConfig(
        checkpoint=served_checkpoint(checkpoint),
        policy_address=policy_address,
        policy_session_address=policy_session_address,
        worker_id=worker_id or f"decode-{socket.gethostname()}-{port}",
        server=ServerConfig(host=host, port=port, max_message_bytes=max_message_bytes, security=security),
        transfer=PairGroupConfig(
            max_groups=max_pair_groups,
            bind_host=transfer_host or (socket.gethostbyname(socket.gethostname()) if wildcard else host),
            store_port=transfer_port,
        ),
        scheduler=SchedulerConfig(max_batch=max_batch, kv_budget_bytes=kv_budget_mib * 1024 * 1024),
        device=device,
        dtype=dtype,
        max_new_tokens=max_new_tokens,
        transfer_timeout_s=transfer_timeout_s,
        lease_timeout_s=lease_timeout_s,
        torch_threads=torch_threads,
    )
    telemetry = TelemetryConfig("decode", log_level, log_format, metrics_host=host, metrics_port=metrics_port)
    with observed(telemetry):
        asyncio.run(serve(config))
