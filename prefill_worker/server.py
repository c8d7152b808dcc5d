"""Lifecycle of one prefill worker process: model, policy client, pair-group sender, gRPC server.

`PrefillServer.start(config)` returns a serving instance (health SERVING while the policy
service is); `stop()` drains gRPC, then closes pair groups, channels and compute threads.
`serve(config)` runs until SIGINT/SIGTERM (what `kvrelay serve prefill` calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import torch

from prefill_worker.admission import Admission
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.handoff import DecodeHandoff
from prefill_worker.manifests import ManifestCache
from prefill_worker.pipeline import PrefillPipeline
from prefill_worker.service import SERVICE_NAME, PrefillServicer
from prefill_worker.wire import RequestLimits
from services.model import LoadedModel, load
from services.policy import PolicyClient, PolicyClientConfig
from services.rpc.kvrelay.v1 import prefill_pb2_grpc
from services.rpc.readiness import ReadinessCheck
from services.rpc.server import RpcServer, ServiceBinding, start_server
from services.telemetry import metrics
from services.transfer import KVSender

log = logging.getLogger(__name__)


class PrefillServer:
    """A running prefill worker."""

    def __init__(
        self,
        config: PrefillWorkerConfig,
        rpc: RpcServer,
        pipeline: PrefillPipeline,
        handoff: DecodeHandoff,
        policy: PolicyClient,
        admission: Admission,
    ) -> None:
        self.config = config
        self.rpc = rpc
        self.pipeline = pipeline
        self.handoff = handoff
        self.policy = policy
        self.admission = admission

    @property
    def address(self) -> str:
        return self.rpc.address

    @classmethod
    async def start(cls, config: PrefillWorkerConfig, model: LoadedModel | None = None) -> PrefillServer:
        """Load the checkpoint (unless `model` is given) and start serving."""
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        if model is None:
            model = await asyncio.to_thread(load, config.checkpoint, config.device, config.dtype)
        policy = PolicyClient(PolicyClientConfig(config.policy_address, timeout_s=config.policy_timeout_s))
        handoff = DecodeHandoff(
            KVSender(config.worker_id, config.pair_groups),
            model.device,
            accept_timeout_s=config.accept_timeout_s,
            max_message_bytes=config.server.max_message_bytes,
        )
        pipeline = PrefillPipeline(
            model,
            policy,
            handoff,
            worker_id=config.worker_id,
            chunk_size=config.chunk_size,
            transfer_timeout_s=config.transfer_timeout_s,
            compute_threads=config.max_in_flight,
        )
        admission = Admission(config.max_in_flight, config.max_queued)
        servicer = PrefillServicer(
            pipeline,
            ManifestCache(policy, model.tensor_contract, config.manifest_cache_size),
            admission,
            RequestLimits(model.config.vocab_size, config.max_prompt_tokens or model.config.max_position_embeddings),
            config.worker_id,
        )
        binding = ServiceBinding(
            SERVICE_NAME, lambda server: prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        )
        metrics.PREFILL_IN_FLIGHT.set_function(lambda: admission.in_flight)
        metrics.PREFILL_QUEUE_DEPTH.set_function(lambda: admission.queued)
        try:
            rpc = await start_server(config.server, [binding], [ReadinessCheck("policy", policy.check_serving)])
        except BaseException:
            await _close(pipeline, handoff, policy)
            raise
        log.info("prefill worker %s on %s, checkpoint %s", config.worker_id, rpc.address, config.checkpoint)
        return cls(config, rpc, pipeline, handoff, policy, admission)

    async def stop(self, grace_s: float | None = None) -> None:
        """Report NOT_SERVING, drain in-flight calls, then release pair groups and channels."""
        await self.rpc.stop(grace_s)
        await _close(self.pipeline, self.handoff, self.policy)


async def _close(pipeline: PrefillPipeline, handoff: DecodeHandoff, policy: PolicyClient) -> None:
    pipeline.close()
    await handoff.close()
    await policy.close()


async def serve(config: PrefillWorkerConfig) -> None:
    """Run until SIGINT or SIGTERM, then stop cleanly."""
    server = await PrefillServer.start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(f"kvrelay prefill worker {config.worker_id} listening on {server.address}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
