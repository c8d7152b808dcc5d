"""Helpers of the prefill worker tests (imported by basename; tests have no packages): a tiny
random Llama checkpoint written without transformers, and a real decode-side endpoint (real
gRPC, real KVReceiver over gloo) that records what reached it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from safetensors.torch import save_file

from services.kvpolicy.packing import PackedKVView
from services.model.config import parse_model_config
from services.model.model import CausalLM
from services.rpc.kvrelay.v1 import decode_pb2, decode_pb2_grpc
from services.rpc.server import RpcServer, ServerConfig, ServiceBinding, start_server
from services.transfer import Deadline, KVReceiver
from services.transfer.codec import handoff_from_proto

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
RECEIVE_S = 30.0


def write_tiny_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (H_q 4, H_kv 2, d_h 16, vocab 97) with random weights, as config.json +
    model.safetensors, named exactly like an HF checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in CausalLM(parse_model_config(TINY_LLAMA)).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator)
        weights[name] = 1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


def prompt_ids(length: int, seed: int) -> list[int]:
    """Token ids in [3, 97) (no BOS/EOS), reproducible."""
    generator = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, TINY_LLAMA["vocab_size"], (length,), generator=generator)]


@dataclass(frozen=True)
class Received:
    """A view that fully arrived at the recording decode worker."""

    view: PackedKVView
    bytes_moved: int


class RecordingDecodeWorker(decode_pb2_grpc.DecodeWorkerServicer):
    """The decode side of a handoff, reduced to receiving: answers GetTransferEndpoint with its
    KVReceiver's store, accepts descriptors (each call waits while `release` is clear; the
    next `refuse_next` calls answer accepted=false), and receives every accepted view in the
    background."""

    def __init__(self, receiver: KVReceiver, worker_id: str = "decode-test") -> None:
        self.receiver = receiver
        self.worker_id = worker_id
        self.endpoint_calls = 0
        self.accepted: list[decode_pb2.TransferDescriptor] = []
        self.release = asyncio.Event()
        self.release.set()
        self.refuse_next = 0
        self._received: dict[str, asyncio.Future[Received]] = {}

    async def GetTransferEndpoint(  # noqa: N802
        self, request: decode_pb2.GetTransferEndpointRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.TransferEndpoint:
        self.endpoint_calls += 1
        return decode_pb2.TransferEndpoint(
            rendezvous_address=self.receiver.address, decode_worker=self.worker_id, backends=["gloo"]
        )

    async def AcceptTransfer(  # noqa: N802
        self, request: decode_pb2.AcceptTransferRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.AcceptTransferResponse:
        message = request.descriptor
        self.accepted.append(message)
        await asyncio.wait_for(self.release.wait(), RECEIVE_S)
        if self.refuse_next > 0:
            self.refuse_next -= 1
            return decode_pb2.AcceptTransferResponse(transfer_id=message.transfer_id, accepted=False)
        # The decode worker's one parser: the descriptor must be a complete, consistent handoff.
        transfer = self.receiver.start_recv(handoff_from_proto(message).descriptor, Deadline.after(RECEIVE_S))

        def receive() -> Received:
            view = transfer.wait_for_view(Deadline.after(RECEIVE_S))
            return Received(view, transfer.bytes_moved)

        self._received[message.transfer_id] = asyncio.get_running_loop().run_in_executor(None, receive)
        return decode_pb2.AcceptTransferResponse(
            transfer_id=message.transfer_id,
            accepted=True,
            reserved_bytes=sum(spec.nbytes for spec in message.tensors),
            decode_worker=self.worker_id,
        )

    async def received(self, transfer_id: str) -> Received:
        return await asyncio.wait_for(self._received[transfer_id], RECEIVE_S)


async def start_recording_decode_worker(worker_id: str = "decode-test") -> tuple[RecordingDecodeWorker, RpcServer]:
    servicer = RecordingDecodeWorker(KVReceiver(), worker_id)
    binding = ServiceBinding(
        decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name,
        lambda server: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server),
    )
    return servicer, await start_server(ServerConfig(port=0, shutdown_grace_s=0.5), [binding])
