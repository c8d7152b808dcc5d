"""Helpers shared by the decode worker tests (imported by basename; tests have no packages).

A tiny random Llama checkpoint, its prefill, policy selections, and a test-side prefill
worker (`describe`) built from the transfer layer's `KVSender` and the one wire codec, so the
decode worker is tested without the real prefill worker.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from services.kvpolicy.compress import StateIdentity, compress
from services.kvpolicy.ledger import (
    Ledger,
    build_ledger,
    ledger_for,
)
from services.kvpolicy.manifest import (
    DType,
    KVVisibilityPolicyManifest,
    TensorContract,
)
from services.kvpolicy.packing import PackedKVView, SourceIdentity
from services.kvpolicy.receipt import Receipt, make_receipt, payload_digest
from services.kvpolicy.state import KVPolicyState
from services.model import LoadedModel, PrefillOptions, PrefillResult, SamplingParams, prefill
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2
from services.transfer import (
    Deadline,
    KVSender,
    OffloadRef,
    PairLease,
    PairRoute,
    SendTransfer,
    Sidecar,
    SidecarLayout,
    TransferDescriptor,
    TransferKey,
    ViewHandoff,
    ViewLayout,
    layer_of,
)
from services.transfer.codec import handoff_to_proto, sampling_from_proto

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


@dataclass(frozen=True)
class PackedState:
    """A packed view, the state it realises and its receipt (what the prefill worker publishes)."""

    manifest: KVVisibilityPolicyManifest
    prefilled: Prefilled
    view: PackedKVView
    state: KVPolicyState
    receipt: Receipt

    @property
    def ledger(self) -> Ledger:
        return ledger_for(self.manifest, self.prefilled.length, self.state.selected_positions)

    def handoff(self, view: PackedKVView | None = None, **changes: object) -> ViewHandoff:
        """The handoff of `view` (default: the packed view) claiming this receipt, with `changes`
        to descriptor fields (`request_id`, `receipt_digest`, generations) or handoff fields
        (`frontier`, `parent_state_generation`, ...). A view other than the packed one gets
        its own ledger, so the handoff stays consistent with the tensors it lists, and, when it
        has other layers or owners, its own row counts as budgets and its own payload digest;
        otherwise the handoff claims the receipt's budgets and payload digest."""
        own = view is None or view is self.view
        view = self.view if view is None else view
        receipt = self.receipt
        names = {f.name for f in fields(TransferDescriptor)}
        descriptor = TransferDescriptor(**{
            "transfer_id": "t-test", "request_id": receipt.request_id,
            "request_generation": receipt.request_generation, "state_generation": receipt.state_generation,
            "cache_generation": receipt.cache_generation, "receipt_digest": receipt.digest,
            "source_worker": "prefill-test", "route": PairRoute("127.0.0.1:1", "gloo", 1, "5" * 64),
            "layout": ViewLayout.of(view), **{k: v for k, v in changes.items() if k in names},
        })
        return ViewHandoff(**{
            "descriptor": descriptor, "manifest_sha256": receipt.manifest_sha256,
            "parent_state_generation": receipt.parent_state_generation, "frontier": receipt.frontier,
            "position_origin": receipt.position_origin, "first_token_id": self.prefilled.first_token,
            "sampling": SamplingParams(), "max_tokens": 8, "prompt_tokens": self.prefilled.length,
            "ledger": self.ledger if own else ledger_of_view(view, self.prefilled.length),
            **claimed_bindings(receipt, view),
            **{k: v for k, v in changes.items() if k not in names},
        })  # type: ignore[arg-type]


def claimed_bindings(receipt: Receipt, view: PackedKVView) -> dict[str, object]:
    """The receipt's owner budgets and payload digest, or `view`'s own (its row counts, its
    bytes) when it has another number of layers or owners than the receipt."""
    budgets = receipt.owner_budgets
    if budgets is not None and (len(budgets), len(budgets[0])) == (view.num_layers, view.num_kv_heads):
        return {"owner_budgets": budgets, "payload": receipt.payload}
    counts = tuple(tuple(len(owner) for owner in layer) for layer in view.selected_positions())
    return {"owner_budgets": counts, "payload": payload_digest(view)}


def ledger_of_view(view: PackedKVView, prompt_len: int) -> Ledger:
    """The ledger of any packed view (K/V-head owners), e.g. one no manifest describes."""
    dtype = (DType(str(view.packed_k.dtype).removeprefix("torch.")), DType(str(view.packed_v.dtype).removeprefix("torch.")))
    contract = TensorContract(view.num_layers, view.num_kv_heads, view.num_kv_heads, view.head_dim, *dtype)
    return build_ledger(contract, prompt_len, view.selected_positions())


def pack_state(
    manifest: KVVisibilityPolicyManifest,
    prefilled: Prefilled,
    request_id: str,
    request_generation: int = 1,
    state_generation: int = 1,
    cache_generation: int = 1,
) -> PackedState:
    """What the prefill worker publishes for `prefilled` under `manifest` (the compression
    core), re-bound to other generations when a test needs a later or a stale state."""
    compressed = compress(manifest, prefilled.result, StateIdentity(request_id, request_generation))
    state = replace(
        compressed.state,
        state_generation=state_generation,
        parent_state_generation=state_generation - 1,
        cache_generation=cache_generation,
    )
    view = compressed.view
    source = SourceIdentity(prefilled.length, cache_generation)  # the image a stale worker would hold
    return PackedState(manifest, prefilled, view, state, make_receipt(manifest, state, view, source=source))


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


def v_shifted(view: PackedKVView) -> PackedKVView:
    """The same positions and K rows with the V rows of (layer 0, owner 0) shifted by one
    against K (each V row moved to the next row, the last to the first): well formed, same
    receipt positions, but not the published bytes."""
    rows = view.rows(0, 0)
    packed_v = view.packed_v.clone()
    packed_v[rows] = torch.roll(packed_v[rows], 1, dims=0)
    return replace(view, packed_v=packed_v)


def k_bit_flipped(view: PackedKVView, layer: int = 0) -> PackedKVView:
    """The same view with the lowest bit of one K element of `layer` flipped."""
    packed_k = view.packed_k.clone()
    bits = packed_k.view(torch.int16 if packed_k.element_size() == 2 else torch.int32)
    bits[view.rows(layer, 0).start, 0] ^= 1
    return replace(view, packed_k=packed_k)


def over_budget(view: PackedKVView) -> PackedKVView:
    """The view with one more row for (layer 0, owner 0): an omitted position (with some row's
    K/V) inserted in order, every later offset moved by one. Well formed; one row over the
    owner's budget when the owner was full."""
    rows = view.rows(0, 0)
    segment = view.original_position_map[rows].tolist()
    extra = next(p for p in range(segment[-1]) if p not in set(segment))
    at = rows.start + sum(p < extra for p in segment)
    insert = lambda t, row: torch.cat([t[:at], row, t[at:]])  # noqa: E731
    offsets = view.row_offsets.clone()
    offsets.view(-1)[1:] += 1
    return PackedKVView(
        packed_k=insert(view.packed_k, view.packed_k[at : at + 1]),
        packed_v=insert(view.packed_v, view.packed_v[at : at + 1]),
        original_position_map=insert(view.original_position_map, torch.tensor([extra], dtype=torch.int32)),
        row_offsets=offsets,
    )


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:10]}"


def sampling_proto(max_tokens: int, **values: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, **values)  # type: ignore[arg-type]


@dataclass
class Sent:
    """A transfer on its way: the handoff and its wire form for AcceptTransfer, the reserved
    pair group, and the sending side once started."""

    message: decode_pb2.TransferDescriptor
    handoff: ViewHandoff
    sender: KVSender
    lease: PairLease
    deadline: Deadline
    transfer: SendTransfer | None = None

    @property
    def descriptor(self) -> TransferDescriptor:
        return self.handoff.descriptor

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
    sidecar: Sidecar | None = None,
    offload: OffloadRef = OffloadRef(),
) -> Sent:
    """Reserve a pair group at the decode worker and build the handoff of `view` (default: the
    packed view) claiming `packed`'s receipt (or `digest`), with `sidecar` (recallable) and
    `offload`, written by the one codec as the prefill worker writes it; nothing is sent yet."""
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
        sidecar=SidecarLayout.of(sidecar, view.packed_v.dtype) if sidecar is not None else None,
    )
    ledger = packed.ledger if view is packed.view else ledger_of_view(view, packed.prefilled.length)
    if sidecar is not None:
        ledger = sidecar.charge(ledger)
    params, max_tokens = sampling_from_proto(sampling or sampling_proto(8))
    handoff = ViewHandoff(
        descriptor=descriptor,
        manifest_sha256=receipt.manifest_sha256,
        parent_state_generation=receipt.parent_state_generation,
        frontier=receipt.frontier,
        position_origin=receipt.position_origin,
        first_token_id=packed.prefilled.first_token,
        sampling=params,
        max_tokens=max_tokens,
        prompt_tokens=packed.prefilled.length,
        ledger=ledger,
        owner_budgets=receipt.owner_budgets,
        payload=receipt.payload,
        deadline_unix_ms=int((time.time() + deadline_s) * 1000),
        offload=offload,
    )
    return Sent(handoff_to_proto(handoff), handoff, sender, lease, deadline)


def send_all(sent: Sent, view: PackedKVView) -> None:
    transfer = sent.transfer or sent.start()
    for layer in range(view.num_layers):
        transfer.send_layer(layer_of(view, layer))
