"""Lifecycle of one decode worker process: model, rendezvous store, decode loop, gRPC server.

`DecodeWorker.start(config)` loads the checkpoint, opens the TCPStore rendezvous on the
transfer port (`config.transfer.store_port`; every pair group with a prefill worker meets
there), starts the decode loop thread and the gRPC server (health and reflection included;
SERVING while the policy service is).
`stop()` drains gRPC, releases every open transfer, stops the loop and closes the pair
groups. `serve(config)` runs until SIGINT/SIGTERM (what `kvrelay serve decode` calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

import torch

from decode_worker.config import DecodeWorkerConfig
from decode_worker.scheduler import DecodeScheduler
from decode_worker.service import SERVICE_NAME, DecodeServicer
from services.model import LoadedModel, load
from services.offload import codes_kernel
from services.policy import PolicyClient, PolicyClientConfig
from services.rpc.kvrelay.v1 import decode_pb2_grpc
from services.rpc.server import RpcServer, ServiceBinding, start_server
from services.telemetry import metrics
from services.transfer import KVReceiver

log = logging.getLogger(__name__)


class DecodeWorker:
    """A running decode worker."""

    def __init__(
        self,
        config: DecodeWorkerConfig,
        rpc: RpcServer,
        servicer: DecodeServicer,
        executor: ThreadPoolExecutor,
    ) -> None:
        self.config = config
        self.rpc = rpc
        self.servicer = servicer
        self._executor = executor

    @property
    def address(self) -> str:
        """host:port of the gRPC server."""
        return self.rpc.address

    @property
    def rendezvous_address(self) -> str:
        """host:port of the TCPStore that prefill workers' pair groups meet at."""
        return self.servicer.receiver.address

    @classmethod
    async def start(cls, config: DecodeWorkerConfig, loaded: LoadedModel | None = None) -> DecodeWorker:
        """Start serving. `loaded` skips loading `config.checkpoint` (a model already in memory)."""
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        if loaded is None:
            loaded = await asyncio.to_thread(load, config.checkpoint, config.device, config.dtype)
        # The codes ranking's kernel, built (once a machine) or loaded before the first request
        # can need it: a build inside a request's step would stall the batch for seconds.
        kernel = await asyncio.to_thread(codes_kernel.describe)
        receiver = await asyncio.to_thread(KVReceiver, config.transfer, config.device)
        scheduler = DecodeScheduler(loaded, config.scheduler)
        scheduler.start()
        policy = PolicyClient(PolicyClientConfig(config.policy_address, timeout_s=config.policy_timeout_s,
                                                 security=config.server.security,
                                                 session_target=config.policy_session_address))
        executor = ThreadPoolExecutor(config.receive_threads, thread_name_prefix="decode-recv")
        servicer = DecodeServicer(config, loaded, scheduler, receiver, policy, executor)
        binding = ServiceBinding(
            SERVICE_NAME, lambda server: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        )
        metrics.DECODE_ACTIVE.set_function(lambda: scheduler.active)
        metrics.DECODE_WAITING.set_function(lambda: scheduler.waiting)
        metrics.DECODE_KV_RESERVED.set_function(lambda: scheduler.budget.used_bytes)
        metrics.DECODE_KV_ALLOCATED.set_function(lambda: scheduler.budget.allocated_bytes)
        try:
            rpc = await start_server(config.server, [binding], [policy.readiness_check(config.server.readiness_timeout_s)])
        except BaseException:
            await _shut(servicer, executor)
            raise
        log.info(
            "decode worker %s on %s, rendezvous %s, model %s, codes kernel %s",
            config.worker_id, rpc.address, receiver.address, loaded.path, kernel,
        )
        return cls(config, rpc, servicer, executor)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain gRPC, release open transfers, stop the decode loop, close the pair groups."""
        await self.rpc.stop(grace_s)
        await _shut(self.servicer, self._executor)


async def _shut(servicer: DecodeServicer, executor: ThreadPoolExecutor) -> None:
    await servicer.close()
    await asyncio.to_thread(servicer.scheduler.stop)
    await asyncio.to_thread(servicer.receiver.close)
    await servicer.policy.close()
    executor.shutdown(wait=False, cancel_futures=True)


async def serve(config: DecodeWorkerConfig) -> None:
    """Run until SIGINT or SIGTERM, then stop cleanly."""
    worker = await DecodeWorker.start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(
        f"kvrelay decode worker {config.worker_id} listening on {worker.address}"
        f" (rendezvous {worker.rendezvous_address})",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await worker.stop()
