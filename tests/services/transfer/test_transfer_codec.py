"""The one wire codec: every domain type of a handoff goes out and comes back unchanged, the
proto conventions are mapped once, and a message whose parts disagree is refused naming the
field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.kvpolicy.compress import owner_capacities
from services.kvpolicy.errors import ReceiptMismatch
from services.kvpolicy.ledger import ledger_for, with_host_tier, with_page_summaries
from services.kvpolicy.manifest import DType, TensorContract, default_manifests
from services.kvpolicy.packing import SourceIdentity, pack
from services.kvpolicy.receipt import Receipt, make_receipt
from services.kvpolicy.state import KVPolicyState
from services.kvpolicy.static import static_protected_positions, static_selection
from services.model.errors import InvalidModelInput
from services.model.sampler import SamplingParams
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2
from services.transfer import (
    DescriptorInvalid,
    PairRoute,
    TransferDescriptor,
    ViewHandoff,
    ViewLayout,
)
from services.transfer.codec import (
    generations_to_proto,
    handoff_from_proto,
    handoff_to_proto,
    ledger_from_proto,
    ledger_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)

CONTRACT = TensorContract(2, 4, 2, 8, DType.FLOAT32, DType.FLOAT32)
MANIFEST = default_manifests(CONTRACT, recent_window=6, sinks=2)["sink-recent"]
LENGTH = 12
SAMPLING = SamplingParams(temperature=0.5, top_k=7, top_p=0.75, seed=3, stop_token_ids=(4, 9))


def packed_receipt() -> tuple[torch.Tensor, Receipt]:
    source = torch.randn(2, 2, LENGTH, 8)  # [L, H_kv, T, d_h]
    selected = static_selection(MANIFEST, LENGTH)
    view = pack(source, source + 1, selected)
    state = KVPolicyState(
        request_id="req-1", manifest_sha256=MANIFEST.sha256, request_generation=3, state_generation=1,
        parent_state_generation=0, cache_generation=1, frontier=LENGTH, selected_positions=selected,
        protected_positions=static_protected_positions(MANIFEST.selection, LENGTH),
        owner_budgets=owner_capacities(MANIFEST, LENGTH, None),
    )
    return view, make_receipt(MANIFEST, state, view, source=SourceIdentity(LENGTH, 1))


def handoff_of(view, receipt: Receipt, **changes: object) -> ViewHandoff:  # type: ignore[no-untyped-def]
    descriptor = TransferDescriptor(
        transfer_id="t-1", request_id=receipt.request_id, request_generation=receipt.request_generation,
        state_generation=receipt.state_generation, cache_generation=receipt.cache_generation,
        receipt_digest=receipt.digest, source_worker="prefill-0", route=PairRoute("10.0.0.7:29500", "gloo", 42, "5" * 64),
        layout=ViewLayout.of(view), trace_context={"traceparent": "00-abc-def-01"},
    )
    fields: dict[str, object] = {
        "descriptor": descriptor, "manifest_sha256": receipt.manifest_sha256,
        "parent_state_generation": receipt.parent_state_generation, "frontier": receipt.frontier,
        "position_origin": receipt.position_origin, "first_token_id": 5, "sampling": SAMPLING, "max_tokens": 9,
        "prompt_tokens": LENGTH, "ledger": ledger_for(MANIFEST, LENGTH, receipt.selected_positions),
        "deadline_unix_ms": 1_700_000_000_000,
        "owner_budgets": receipt.owner_budgets, "payload": receipt.payload,
    }
    return ViewHandoff(**{**fields, **changes})  # type: ignore[arg-type]


def test_sampling_maps_the_proto_conventions_once() -> None:
    params, max_tokens = sampling_from_proto(common_pb2.SamplingParams(max_tokens=4))
    assert (params, max_tokens) == (SamplingParams(top_p=1.0, seed=None), 4)  # top_p 0 -> 1, seed 0 -> None
    assert sampling_from_proto(sampling_to_proto(SAMPLING, 9)) == (SAMPLING, 9)
    with pytest.raises(InvalidModelInput) as caught:
        sampling_from_proto(common_pb2.SamplingParams(top_p=1.5, max_tokens=1))
    assert caught.value.field == "sampling.top_p"


def test_ledger_travels_as_its_counts_and_bytes_must_follow_from_them() -> None:
    _, receipt = packed_receipt()
    base = ledger_for(MANIFEST, LENGTH, receipt.selected_positions)
    ledger = with_host_tier(with_page_summaries(base, 96), 640)
    message = ledger_to_proto(ledger, bytes_moved=ledger.traffic_bytes, recalled_bytes=12)
    assert message.visible_payload_bytes == ledger.visible_payload_bytes and message.recalled_bytes == 12
    assert message.row_offsets_bytes == ledger.offsets_bytes
    assert ledger_from_proto(message) == ledger
    tampered = common_pb2.Ledger()
    tampered.CopyFrom(message)
    tampered.full_payload_bytes += 1
    with pytest.raises(DescriptorInvalid) as caught:
        ledger_from_proto(tampered)
    assert caught.value.field == "ledger" and "full_payload_bytes" in caught.value.reason
    tampered.CopyFrom(message)
    tampered.visible_rows = -1
    with pytest.raises(DescriptorInvalid) as caught:
        ledger_from_proto(tampered)
    assert caught.value.field == "ledger.visible_rows"


def test_handoff_round_trips_and_rebuilds_the_published_receipt() -> None:
    view, receipt = packed_receipt()
    handoff = handoff_of(view, receipt)
    message = handoff_to_proto(handoff)
    assert message.receipt.generations == generations_to_proto(receipt)
    assert message.receipt.retained_rows == view.total_rows == handoff.ledger.visible_rows
    parsed = handoff_from_proto(decode_pb2.TransferDescriptor.FromString(message.SerializeToString()))
    assert parsed == handoff
    # What the decode worker does once the view arrived: the positions come from the view.
    assert parsed.receipt(view.selected_positions(), receipt.protected_positions) == receipt
    moved = [list(owner) for owner in view.selected_positions()[0]]
    moved[0][-1] += 1
    with pytest.raises(ReceiptMismatch) as caught:
        parsed.receipt(((tuple(moved[0]), tuple(moved[1])), view.selected_positions()[1]), receipt.protected_positions)
    assert caught.value.field == "digest"


def test_budgets_and_payload_digest_travel_and_are_bound_by_the_receipt_digest() -> None:
    """Row-major budgets and per-layer (K, V) digests on the wire; a handoff claiming other
    budgets or another payload digest no longer recomputes the published receipt."""
    view, receipt = packed_receipt()
    assert receipt.owner_budgets is not None and receipt.payload is not None
    message = handoff_to_proto(handoff_of(view, receipt))
    assert list(message.receipt.owner_budgets) == [b for row in receipt.owner_budgets for b in row]
    assert [(d.k, d.v) for d in message.receipt.payload_digests] == list(receipt.payload.layers)
    assert message.receipt.payload_hash == receipt.payload.hash
    positions = view.selected_positions()
    bigger = tuple(tuple(b + 1 for b in row) for row in receipt.owner_budgets)
    other_payload = dataclasses.replace(receipt.payload, layers=receipt.payload.layers[::-1])
    for change in ({"owner_budgets": bigger}, {"payload": other_payload}):
        with pytest.raises(ReceiptMismatch) as caught:
            handoff_of(view, receipt, **change).receipt(positions, receipt.protected_positions)
        assert caught.value.field == "digest"


def test_handoff_parts_that_disagree_are_refused_naming_the_field() -> None:
    view, receipt = packed_receipt()
    message = handoff_to_proto(handoff_of(view, receipt))
    cases = {
        "receipt.retained_rows": lambda m: setattr(m.receipt, "retained_rows", m.receipt.retained_rows - 1),
        "receipt.omitted_rows": lambda m: setattr(m.receipt, "omitted_rows", 0),
        "receipt.generations.state_generation": lambda m: setattr(m.receipt.generations, "parent_state_generation", 1),
        "receipt.frontier": lambda m: setattr(m.receipt, "frontier", 0),
        "ledger": lambda m: m.ClearField("ledger"),
        "sampling.top_p": lambda m: setattr(m.sampling, "top_p", 2.0),
        "recoverability": lambda m: setattr(m, "recoverability", "somewhere"),
        "tensors": lambda m: setattr(m, "recoverability", "recallable_local"),
        "offload_handoff_id": lambda m: setattr(m, "offload_handoff_id", "h-1"),
        "receipt.owner_budgets": lambda m: m.receipt.owner_budgets.pop(),
        "receipt.owner_budgets[1][0]": lambda m: m.receipt.owner_budgets.__setitem__(2, -1),
        "receipt.payload_hash": lambda m: setattr(m.receipt, "payload_hash", ""),
        "receipt.payload_digests": lambda m: m.receipt.payload_digests.pop(),
        "receipt.payload_digests[1].v": lambda m: setattr(m.receipt.payload_digests[1], "v", "not hex"),
    }
    for field, corrupt in cases.items():
        broken = decode_pb2.TransferDescriptor.FromString(message.SerializeToString())
        corrupt(broken)
        with pytest.raises(DescriptorInvalid) as caught:
            handoff_from_proto(broken)
        assert caught.value.field == field, field


def test_a_handoff_whose_ledger_is_not_its_tensors_cannot_be_built() -> None:
    view, receipt = packed_receipt()
    handoff = handoff_of(view, receipt)
    with pytest.raises(DescriptorInvalid) as caught:
        dataclasses.replace(handoff, ledger=with_page_summaries(handoff.ledger, 8))
    assert caught.value.field == "ledger"


def test_a_handoff_whose_budgets_or_digests_are_not_its_layouts_cannot_be_built() -> None:
    view, receipt = packed_receipt()
    handoff = handoff_of(view, receipt)
    with pytest.raises(DescriptorInvalid) as budgets:
        dataclasses.replace(handoff, owner_budgets=handoff.owner_budgets[:1])
    assert budgets.value.field == "receipt.owner_budgets"
    with pytest.raises(DescriptorInvalid) as digests:
        dataclasses.replace(handoff, payload=dataclasses.replace(handoff.payload, layers=()))
    assert digests.value.field == "receipt.payload_digests"
