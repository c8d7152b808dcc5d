"""Lifecycle of one prefill worker process: model, policy client, pair-group sender, offload
tier, gRPC server (PrefillWorker and OffloadService on one port).

`PrefillServer.start(config)` returns a serving instance (health SERVING while the policy
service is) and starts the offload tier's sweep; `stop()` drains gRPC, stops the sweep,
waits for recall sends, then closes pair groups, channels and compute threads.
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
from prefill_worker.manifests import ServableManifests
from prefill_worker.offload import OffloadTier
from prefill_worker.offload_service import SERVICE_NAME as OFFLOAD_SERVICE_NAME
from prefill_worker.offload_service import OffloadServicer, sweep_forever
from prefill_worker.pipeline import PrefillPipeline
from prefill_worker.service import SERVICE_NAME, PrefillServicer
from prefill_worker.wire import RequestLimits
from services.kvpolicy.fit import Deployment
from services.kvpolicy.head_profile import load_profile
from services.model import LoadedModel, load
from services.policy import PolicyClient, PolicyClientConfig
from services.policy.manifests import ManifestCache
from services.rpc.kvrelay.v1 import offload_pb2_grpc, prefill_pb2_grpc
from services.rpc.server import RpcServer, ServerConfig, ServiceBinding, start_server
from services.telemetry import metrics
from services.transfer import KVSender

log = logging.getLogger(__name__)


class PrefillServer:
    """A running prefill worker: the pipeline, and the offload tier its OffloadService serves
    (swept by a background task)."""

    def __init__(
        self,
        config: PrefillWorkerConfig,
        rpc: RpcServer,
        pipeline: PrefillPipeline,
        handoff: DecodeHandoff,
        policy: PolicyClient,
        admission: Admission,
        offload: OffloadServicer,
        sweeper: asyncio.Task[None],
    ) -> None:
        self.config = config
        self.rpc = rpc
        self.pipeline = pipeline
        self.handoff = handoff
        self.policy = policy
        self.admission = admission
        self.offload = offload
        self._sweeper = sweeper

    @property
    def tier(self) -> OffloadTier:
        return self.offload.tier

    @property
    def address(self) -> str:
        return self.rpc.address

    @classmethod
    async def start(cls, config: PrefillWorkerConfig, model: LoadedModel | None = None) -> PrefillServer:
        """Load the checkpoint (unless `model` is given) and the HeadKV profile beside it (if
        any), then start serving."""
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        if model is None:
            model = await asyncio.to_thread(load, config.checkpoint, config.device, config.dtype)
        profile = await asyncio.to_thread(load_profile, config.checkpoint)
        if profile is not None:
            shape = model.config
            profile.check_shape(shape.num_layers, shape.num_q_heads, shape.num_kv_heads)
        policy = PolicyClient(PolicyClientConfig(config.policy_address, timeout_s=config.policy_timeout_s,
                                                 security=config.server.security,
                                                 session_target=config.policy_session_address))
        tier = OffloadTier(config.offload.store(), config.offload.advertise_address)
        handoff = DecodeHandoff(
            KVSender(config.worker_id, config.pair_groups),
            model.device,
            accept_timeout_s=config.accept_timeout_s,
            max_message_bytes=config.server.max_message_bytes,
            security=config.server.security,
            offload=tier,
        )
        pipeline = PrefillPipeline(
            model,
            policy,
            handoff,
            worker_id=config.worker_id,
            chunk_size=config.chunk_size,
            transfer_timeout_s=config.transfer_timeout_s,
            compute_threads=config.max_in_flight,
            profile=profile,
            offload=tier,
        )
        admission = Admission(config.max_in_flight, config.max_queued)
        context = model.config.max_position_embeddings
        servicer = PrefillServicer(
            pipeline,
            ServableManifests(ManifestCache(policy, capacity=config.manifest_cache_size),
                              Deployment(model.tensor_contract, offload_store=tier.serves_remote)),
            admission,
            RequestLimits(model.config.vocab_size, config.max_prompt_tokens or context, context),
            config.worker_id,
        )
        offload = OffloadServicer(tier, policy, handoff.sender, model.device, policy_timeout_s=config.policy_timeout_s,
                                  send_timeout_s=config.offload.recall_send_timeout_s)
        bindings = [
            ServiceBinding(
                SERVICE_NAME, lambda server: prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
            ),
            ServiceBinding(
                OFFLOAD_SERVICE_NAME,
                lambda server: offload_pb2_grpc.add_OffloadServiceServicer_to_server(offload, server),
            ),
        ]
        metrics.PREFILL_IN_FLIGHT.set_function(lambda: admission.in_flight)
        metrics.PREFILL_QUEUE_DEPTH.set_function(lambda: admission.queued)
        metrics.OFFLOAD_STORE_BYTES.set_function(lambda: tier.store.used_bytes if tier.store else 0)
        try:
            rpc = await start_server(config.server, bindings, [policy.readiness_check(config.server.readiness_timeout_s)])
        except BaseException:
            await _close(pipeline, handoff, policy)
            raise
        tier.address = tier.address or ServerConfig(config.pair_groups.bind_host, rpc.port).bind_address
        sweeper = asyncio.get_running_loop().create_task(
            sweep_forever(tier, policy, config.offload.sweep_interval_s, config.policy_timeout_s)
        )
        log.info("prefill worker %s on %s, checkpoint %s, offload tier at %s", config.worker_id, rpc.address,
                 config.checkpoint, tier.address)
        return cls(config, rpc, pipeline, handoff, policy, admission, offload, sweeper)

    async def stop(self, grace_s: float | None = None) -> None:
        """Report NOT_SERVING, drain in-flight calls, then release pair groups and channels."""
        await self.rpc.stop(grace_s)
        self._sweeper.cancel()
        await asyncio.gather(self._sweeper, return_exceptions=True)
        await self.offload.close()
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
