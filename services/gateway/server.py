"""Lifecycle of one gateway process: the served checkpoint's metadata (tokenizer, context
length, tensor contract; no weights), the default manifests, worker discovery, gRPC server.

`GatewayServer.start(config)` returns a serving instance; its gRPC health reports SERVING
while the policy service serves and each role has a healthy worker. With `config.http` it also
serves the OpenAI-compatible HTTP front (services/gateway/openai_api) over the same prompt
validator and orchestrator; its `/health` follows the same readiness, and `authenticate` (a
hook that sees each HTTP request's headers) may refuse a request. `stop()` stops the HTTP
front, drains gRPC and closes the pools, the tokenizer threads and the policy client. `serve(config)` runs until
SIGINT/SIGTERM (what `kvrelay serve gateway` calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.gateway.config import GatewayConfig
from services.gateway.discovery import WorkerPool
from services.gateway.orchestrator import DECODE_SERVICE, PREFILL_SERVICE, Deadlines, Orchestrator
from services.gateway.policies import ManifestResolver, register_defaults
from services.gateway.prompts import PromptValidator
from services.gateway.service import SERVICE_NAME, GatewayServicer
from services.gateway.validation import RequestLimits
from services.kvpolicy.manifest import TensorContract
from services.model.config import ModelConfig, make_tensor_contract, resolve_dtype
from services.model.loader import read_checkpoint
from services.model.tokenizer import TextTokenizer
from services.policy import PolicyClient, PolicyClientConfig, PolicyUnavailable
from services.rpc.kvrelay.v1 import gateway_pb2_grpc
from services.rpc.readiness import ReadinessCheck
from services.rpc.server import RpcServer, ServiceBinding, start_server
from services.security.access import api_key_check

if TYPE_CHECKING:
    from services.gateway.openai_api.app import Authenticate
    from services.gateway.openai_api.server import HttpServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """What the gateway needs of the checkpoint the workers serve."""

    tokenizer: TextTokenizer
    config: ModelConfig
    contract: TensorContract

    @classmethod
    def read(cls, checkpoint: Path, dtype: str | None) -> ServedModel:
        """Config and tokenizer of `checkpoint` (HF directory or `.gguf` file, no weights);
        `dtype` is the workers' K/V dtype."""
        info = read_checkpoint(checkpoint)
        config = info.config
        contract = make_tensor_contract(config, resolve_dtype(dtype, config.checkpoint_dtype))
        return cls(info.require_tokenizer(), config, contract)

    def limits(self, config: GatewayConfig) -> RequestLimits:
        context = self.config.max_position_embeddings
        return RequestLimits(
            vocab_size=self.config.vocab_size,
            context_length=context,
            max_prompt_tokens=min(config.max_prompt_tokens or context - 1, context - 1),
            max_tokens_limit=config.max_tokens_limit,
            default_max_tokens=config.default_max_tokens,
        )


class GatewayServer:
    """A running gateway."""

    def __init__(self, config: GatewayConfig, rpc: RpcServer, policy: PolicyClient,
                 pools: tuple[WorkerPool, WorkerPool], orchestrator: Orchestrator, prompts: PromptValidator,
                 http: HttpServer | None = None) -> None:
        self.config = config
        self.http = http
        self.rpc = rpc
        self.policy = policy
        self.prefill_pool, self.decode_pool = pools
        self.orchestrator = orchestrator
        self.prompts = prompts

    @property
    def address(self) -> str:
        return self.rpc.address

    @classmethod
    async def start(cls, config: GatewayConfig, authenticate: Authenticate | None = None) -> GatewayServer:
        served = await asyncio.to_thread(ServedModel.read, config.checkpoint, config.dtype)
        security = config.server.security
        policy = PolicyClient(PolicyClientConfig(config.policy_address, timeout_s=config.policy_timeout_s,
                                                 security=security, session_target=config.policy_session_address))
        pools = (
            WorkerPool("prefill", PREFILL_SERVICE, config.prefill_workers, config.discovery,
                       max_message_bytes=config.server.max_message_bytes, security=security,
                       max_outstanding=config.prefill_max_outstanding, max_waiting=config.admission_max_waiting),
            WorkerPool("decode", DECODE_SERVICE, config.decode_workers, config.discovery,
                       max_message_bytes=config.server.max_message_bytes, security=security,
                       max_outstanding=config.decode_max_outstanding, max_waiting=config.admission_max_waiting),
        )
        prompts = PromptValidator(served.limits(config), served.tokenizer, config.tokenizer_threads,
                                  config.tokenizer_max_waiting)
        try:
            if config.register_default_manifests:
                await _register_when_reachable(policy, served.contract, config.startup_timeout_s)
            for pool in pools:
                await pool.start()
            orchestrator = Orchestrator(
                policy,
                ManifestResolver(policy, served.contract, config.default_policy,
                                 name_ttl_s=config.manifest_cache_ttl_s, timeout_s=config.policy_timeout_s,
                                 restore_defaults=config.register_default_manifests),
                *pools,
                decode_text=lambda ids: served.tokenizer.decode(list(ids)),
                deadlines=Deadlines(config.prefill_timeout_s, config.first_event_timeout_s,
                                    config.event_timeout_s, config.policy_timeout_s, config.admission_timeout_s),
                max_retries=config.max_retries,
            )
            servicer = GatewayServicer(prompts, orchestrator)
            binding = ServiceBinding(SERVICE_NAME, lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s))
            rpc = await start_server(config.server, [binding], readiness_checks(policy, *pools, within_s=config.server.readiness_timeout_s))
            http = await _start_http(config, prompts, orchestrator, rpc, authenticate)
        except BaseException:
            for pool in pools:
                await pool.close()
            await policy.close()
            prompts.close()
            raise
        log.info("gateway on %s: prefill %s, decode %s, policy %s", rpc.address, config.prefill_workers,
                 config.decode_workers, config.policy_address)
        return cls(config, rpc, policy, pools, orchestrator, prompts, http)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop the HTTP front, drain gRPC, finish pending EndRequest calls, close pools and
        the policy client."""
        if self.http is not None:
            await self.http.stop()
        await self.rpc.stop(grace_s)
        await self.orchestrator.close()
        await self.prefill_pool.close()
        await self.decode_pool.close()
        await self.policy.close()
        self.prompts.close()


async def _start_http(config: GatewayConfig, prompts: PromptValidator, orchestrator: Orchestrator, rpc: RpcServer,
                      authenticate: Authenticate | None) -> HttpServer | None:
    if config.http is None:
        return None
    # Imported here: FastAPI and uvicorn load only in a gateway that serves HTTP.
    from services.gateway.openai_api.app import Front, create_app
    from services.gateway.openai_api.server import HttpServer

    if authenticate is None and config.server.security.tokens:
        authenticate = api_key_check(config.server.security.tokens)  # the API keys of gRPC Generate
    if authenticate is None:
        log.warning("HTTP front without authentication: every caller may generate")
    front = Front(prompts, orchestrator, config.http.model_name or _model_name(config.checkpoint),
                  ready=lambda: rpc.readiness.ready, request_timeout_s=config.http.request_timeout_s,
                  max_body_bytes=config.server.max_message_bytes, authenticate=authenticate)
    try:
        return await HttpServer.start(config.http, create_app(front))
    except BaseException:
        await rpc.stop(0)
        raise


def _model_name(checkpoint: Path) -> str:
    """The model id of the HTTP front: the checkpoint's file name without `.gguf`, or its directory's."""
    return checkpoint.stem if checkpoint.suffix.lower() == ".gguf" else checkpoint.name


def readiness_checks(policy: PolicyClient, prefill: WorkerPool, decode: WorkerPool, *,
                     within_s: float) -> list[ReadinessCheck]:
    """SERVING while the policy service serves and each role has a healthy worker (each probe
    bounded by `within_s`)."""
    return [
        policy.readiness_check(within_s),
        ReadinessCheck("prefill workers", prefill.check_any_healthy),
        ReadinessCheck("decode workers", decode.check_any_healthy),
    ]


async def _register_when_reachable(policy: PolicyClient, contract: TensorContract, timeout_s: float) -> None:
    """Register the default manifests, waiting up to `timeout_s` for the policy service."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            registrations = await register_defaults(policy, contract, timeout_s=max(deadline - time.monotonic(), 0.1))
        except PolicyUnavailable:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)
            continue
        created = [r.ref.name for r in registrations if r.created]
        log.info("default manifests: %d registered now, %d already present", len(created), len(registrations) - len(created))
        return


async def serve(config: GatewayConfig) -> None:
    """Run until SIGINT or SIGTERM, then stop cleanly."""
    server = await GatewayServer.start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(f"kvrelay gateway listening on {server.address}", flush=True)
    if server.http is not None:
        print(f"kvrelay gateway HTTP (OpenAI API) on {server.http.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
