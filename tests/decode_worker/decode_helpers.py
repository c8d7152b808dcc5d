"""Helpers shared by the decode worker tests (imported by basename; tests have no packages).

A tiny random Llama checkpoint, its prefill, policy selections, and a test-side prefill
worker (`send_view`) built from the transfer layer's `KVSender`, so the decode worker is
tested without the real prefill worker.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from decode_worker.wire import ReceiptClaim
from services.kvpolicy import allocation, snapkv
from services.kvpolicy.ledger import ledger_for
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, SelectionMethod, TensorContract
from services.kvpolicy.packing import PackedKVView, pack
from services.kvpolicy.receipt import Receipt, make_receipt
from services.kvpolicy.state import KVPolicyState, PositionGrid
from services.kvpolicy.static import static_protected_positions, static_selection
from services.model import LoadedModel, PrefillOptions, PrefillResult, prefill
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2
from services.transfer import (
    Deadline,
    KVSender,
    PairLease,
    SendTransfer,
    TransferDescriptor,
    TransferKey,
    ViewLayout,
    layer_of,
    to_proto,
)

VOCAB, EOS = 97, 2
OBS_WINDOW = 4
KV_BUDGET_BYTES = 8 * 1024 * 1024  # the test decode worker's budget
LEASE_TIMEOUT_S = 2.0  # the test decode worker's stream lease


def save_tiny_llama(directory: Path, seed: int = 0) -> None:
    """A 2-layer Llama (d_model 64, 4 query heads on 2 K/V heads, head_dim 16), float32."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # slow import, only where needed

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=EOS,
    )
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(directory, safe_serialization=True)


def prompt_ids(length: int, seed: int) -> list[int]:
    """Token ids avoiding EOS, so greedy runs are not cut short by the prompt."""
    generator = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, VOCAB, (length,), generator=generator)]


@dataclass(frozen=True)
class Prefilled:
    prompt: list[int]
    result: PrefillResult
    first_token: int  # greedy, from the last prompt logits

    @property
    def length(self) -> int:
        return len(self.prompt)


def synthetic_prefill(contract: TensorContract, length: int, seed: int) -> Prefilled:
    """Random K/V `[L, H_kv, T, d_h]` and observation attention `[L, H_q, W, T]` shaped like
    a prefill of `contract` (no model needed)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (contract.num_layers, contract.num_kv_heads, length, contract.head_dim)
    window = min(OBS_WINDOW, length)
    scores = torch.randn(contract.num_layers, contract.num_q_heads, window, length, generator=generator)
    result = PrefillResult(
        logits=torch.randn(VOCAB, generator=generator),
        source_k=torch.randn(shape, generator=generator),
        source_v=torch.randn(shape, generator=generator),
        observation=torch.softmax(scores, dim=-1),
    )
    return Prefilled(prompt_ids(length, seed), result, int(result.logits.argmax()))


def run_prefill(loaded: LoadedModel, prompt: list[int]) -> Prefilled:
    result = prefill(loaded.model, prompt, PrefillOptions(obs_window=OBS_WINDOW))
    return Prefilled(prompt, result, int(result.logits.argmax()))


def selection_for(manifest: KVVisibilityPolicyManifest, prefilled: Prefilled) -> PositionGrid:
    """What the prefill worker retains under `manifest`: static positions, or SnapKV's."""
    length = prefilled.length
    if manifest.selection.method is not SelectionMethod.SNAPKV:
        return static_selection(manifest, length)
    scores = snapkv.score(manifest, prefilled.result.observation, length)
    budgets = allocation.allocate(manifest, length, scores)
    return snapkv.select(manifest, scores, budgets, length)


def protected_for(manifest: KVVisibilityPolicyManifest, length: int) -> tuple[int, ...]:
    if manifest.selection.method is SelectionMethod.SNAPKV:
        return snapkv.protected_positions(manifest, length)
    return static_protected_positions(manifest.selection, length)


@dataclass(frozen=True)
class PackedState:
    """A packed view, the state it realises and its receipt (what the prefill worker publishes)."""

    manifest: KVVisibilityPolicyManifest
    prefilled: Prefilled
    view: PackedKVView
    state: KVPolicyState
    receipt: Receipt

    @property
    def claim(self) -> ReceiptClaim:
        receipt = self.receipt
        return ReceiptClaim(
            digest=receipt.digest,
            manifest_sha256=receipt.manifest_sha256,
            request_id=receipt.request_id,
            request_generation=receipt.request_generation,
            state_generation=receipt.state_generation,
            parent_state_generation=receipt.parent_state_generation,
            cache_generation=receipt.cache_generation,
            frontier=receipt.frontier,
            position_origin=receipt.position_origin,
        )


def pack_state(
    manifest: KVVisibilityPolicyManifest,
    prefilled: Prefilled,
    request_id: str,
    request_generation: int = 1,
    state_generation: int = 1,
    cache_generation: int = 1,
) -> PackedState:
    selected = selection_for(manifest, prefilled)
    view = pack(prefilled.result.source_k, prefilled.result.source_v, selected)
    state = KVPolicyState(
        request_id=request_id,
        manifest_sha256=manifest.sha256,
        request_generation=request_generation,
        state_generation=state_generation,
        parent_state_generation=state_generation - 1,
        cache_generation=cache_generation,
        frontier=prefilled.length,
        selected_positions=selected,
        protected_positions=protected_for(manifest, prefilled.length),
    )
    return PackedState(manifest, prefilled, view, state, make_receipt(manifest, state, view))


def tampered(view: PackedKVView) -> PackedKVView:
    """The same rows with one retained position of (layer 0, owner 0) moved to the omitted
    position right after it (still ascending): well formed, but not what the receipt promised."""
    positions = view.original_position_map.clone()
    rows = view.rows(0, 0)
    segment = positions[rows].tolist()
    index = next(i for i, p in enumerate(segment[:-1]) if segment[i + 1] != p + 1)
    segment[index] += 1
    positions[rows] = torch.tensor(segment, dtype=positions.dtype)
    return replace(view, original_position_map=positions)


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:10]}"


def sampling_proto(max_tokens: int, **values: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, **values)  # type: ignore[arg-type]


@dataclass
class Sent:
    """A transfer on its way: the wire descriptor for AcceptTransfer, the reserved pair group,
    and the sending side once started."""

    message: decode_pb2.TransferDescriptor
    descriptor: TransferDescriptor
    sender: KVSender
    lease: PairLease
    deadline: Deadline
    transfer: SendTransfer | None = None

    def start(self) -> SendTransfer:
        self.transfer = self.sender.start_send(self.descriptor, self.lease, self.deadline)
        return self.transfer

    def refused(self) -> None:
        """AcceptTransfer said no: give the reserved pair group up."""
        if self.transfer is not None:
            self.transfer.cancel("refused by the decode worker")
        else:
            self.sender.cancel(self.lease, "refused by the decode worker")


def describe(
    packed: PackedState,
    sender: KVSender,
    rendezvous_address: str,
    *,
    view: PackedKVView | None = None,
    digest: str | None = None,
    sampling: common_pb2.SamplingParams | None = None,
    deadline_s: float = 10.0,
) -> Sent:
    """Reserve a pair group at the decode worker and build the descriptor of `view` (default:
    the packed view) claiming `packed`'s receipt (or `digest`); nothing is sent yet."""
    view = view if view is not None else packed.view
    receipt = packed.receipt
    key = TransferKey(receipt.request_id, receipt.request_generation, receipt.state_generation, uuid.uuid4().hex[:12])
    deadline = Deadline.after(deadline_s)
    lease = sender.reserve(key, rendezvous_address, "cpu", deadline)
    descriptor = TransferDescriptor(
        transfer_id=key.transfer_id,
        request_id=key.request_id,
        request_generation=key.request_generation,
        state_generation=key.state_generation,
        cache_generation=receipt.cache_generation,
        receipt_digest=digest or receipt.digest,
        source_worker=sender.worker_id,
        route=lease.route,
        layout=ViewLayout.of(view),
    )
    message = to_proto(descriptor)
    message.receipt.manifest_sha256 = receipt.manifest_sha256
    message.receipt.generations.parent_state_generation = receipt.parent_state_generation
    message.receipt.frontier = receipt.frontier
    message.receipt.position_origin = receipt.position_origin
    message.first_token_id = packed.prefilled.first_token
    message.sampling.CopyFrom(sampling or sampling_proto(8))
    message.prompt_tokens = packed.prefilled.length
    message.deadline_unix_ms = int((time.time() + deadline_s) * 1000)
    message.ledger.CopyFrom(ledger_proto(packed))
    return Sent(message, descriptor, sender, lease, deadline)


def ledger_proto(packed: PackedState) -> common_pb2.Ledger:
    ledger = ledger_for(packed.manifest, packed.prefilled.length, packed.state.selected_positions)
    return common_pb2.Ledger(
        bytes_per_row=ledger.bytes_per_row,
        full_payload_bytes=ledger.full_payload_bytes,
        visible_payload_bytes=ledger.visible_payload_bytes,
        position_map_bytes=ledger.position_map_bytes,
        row_offsets_bytes=ledger.offsets_bytes,
        transaction_peak_bytes=ledger.transaction_peak_bytes,
    )


def send_all(sent: Sent, view: PackedKVView) -> None:
    transfer = sent.transfer or sent.start()
    for layer in range(view.num_layers):
        transfer.send_layer(layer_of(view, layer))
