"""Descriptor, wire layout and deadline: pure data, no processes."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import time

import pytest
import torch

from services.kvpolicy.ledger import build_ledger
from services.kvpolicy.manifest import DType, TensorContract
from services.kvpolicy.packing import PackedKVView, pack
from services.transfer import (
    Deadline,
    DescriptorInvalid,
    PairRoute,
    TransferDescriptor,
    TransferKey,
    TransferMismatch,
    ViewLayout,
    layer_of,
)
from services.transfer.codec import descriptor_from_proto, descriptor_to_proto
from services.transfer.layout import TensorSpec, check_layer, layout_from_specs

SELECTED = [[[0, 2, 5], [1]], [[], [0, 1, 2, 3, 4, 5]], [[3], [4]]]
KEY = TransferKey("req-1", 4, 7, "t-1")


def _view(dtype: torch.dtype = torch.bfloat16) -> PackedKVView:
    source = torch.randn(3, 2, 6, 8).to(dtype)  # [L, H_kv, T, d_h]
    return pack(source, source + 1, SELECTED)


def _descriptor(view: PackedKVView | None = None, **changes: object) -> TransferDescriptor:
    fields = {
        "transfer_id": KEY.transfer_id,
        "request_id": KEY.request_id,
        "request_generation": KEY.request_generation,
        "state_generation": KEY.state_generation,
        "cache_generation": 9,
        "receipt_digest": hashlib.sha256(b"receipt").hexdigest(),
        "source_worker": "prefill-0",
        "route": PairRoute("10.0.0.7:29500", "gloo", 123456789, "5" * 64),
        "layout": ViewLayout.of(view or _view()),
        "trace_context": {"traceparent": "00-abc-def-01", "tracestate": "k=v"},
    }
    fields.update(changes)
    return TransferDescriptor(**fields)  # type: ignore[arg-type]


def test_layout_lists_four_messages_per_layer_and_matches_the_ledger() -> None:
    view = _view()
    layout = ViewLayout.of(view)
    assert layout.layer_rows == (4, 6, 2)
    assert [s.name for s in layout.layer_specs(1)] == [
        "row_offsets[1]", "original_position_map[1]", "packed_k[1]", "packed_v[1]",
    ]
    assert layout.layer_specs(1)[2] == TensorSpec("packed_k[1]", (6, 8), "bfloat16")
    contract = TensorContract(
        num_layers=3, num_q_heads=2, num_kv_heads=2, head_dim=8, k_dtype=DType.BFLOAT16, v_dtype=DType.BFLOAT16
    )
    ledger = build_ledger(contract, 6, SELECTED)
    assert layout.nbytes == ledger.traffic_bytes == view.payload_bytes + view.metadata_bytes
    assert layout_from_specs(layout.specs()) == layout


def test_layers_slice_the_view_without_copies() -> None:
    view = _view()
    layer = layer_of(view, 1)
    assert layer.row_offsets.tolist() == [4, 4, 10]
    assert layer.original_position_map.tolist() == [0, 1, 2, 3, 4, 5]
    assert layer.packed_k.data_ptr() == view.packed_k[4].data_ptr()
    assert sum(layer_of(view, n).nbytes for n in range(3)) == ViewLayout.of(view).nbytes
    check_layer(ViewLayout.of(view), layer, KEY)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda layer: dataclasses.replace(layer, packed_k=layer.packed_k[1:]), "packed_k[1]"),
        (lambda layer: dataclasses.replace(layer, packed_v=layer.packed_v.float()), "packed_v[1]"),
        (lambda layer: dataclasses.replace(layer, row_offsets=layer.row_offsets - 1), "row_offsets[1]"),
        (lambda layer: dataclasses.replace(layer, row_offsets=layer.row_offsets.flip(0)), "row_offsets[1]"),
        (lambda layer: dataclasses.replace(layer, layer=3), "layer"),
    ],
)
def test_a_layer_that_disagrees_with_the_layout_is_a_mismatch(change, field) -> None:  # type: ignore[no-untyped-def]
    view = _view()
    with pytest.raises(TransferMismatch) as caught:
        check_layer(ViewLayout.of(view), change(layer_of(view, 1)), KEY)
    assert caught.value.field == field
    assert caught.value.key == KEY


def test_descriptor_round_trips_through_the_proto() -> None:
    descriptor = _descriptor()
    message = descriptor_to_proto(descriptor)
    assert message.rendezvous_address == "10.0.0.7:29500/gloo/123456789"
    # The generations travel once, in the receipt (no top-level request_generation to disagree).
    assert "request_generation" not in type(message).DESCRIPTOR.fields_by_name
    assert message.receipt.generations.request_generation == 4
    assert message.receipt.generations.state_generation == 7
    assert message.receipt.generations.cache_generation == 9
    assert len(message.tensors) == 12
    assert sum(t.nbytes for t in message.tensors) == descriptor.layout.nbytes
    assert dict(message.trace_context) == {"traceparent": "00-abc-def-01", "tracestate": "k=v"}
    parsed = descriptor_from_proto(type(message).FromString(message.SerializeToString()))
    assert parsed == descriptor
    assert parsed.key == KEY


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"source_worker": "a/b"}, "source_worker"),
        ({"state_generation": -1}, "state_generation"),
        ({"cache_generation": True}, "cache_generation"),
        ({"receipt_digest": "ABC"}, "receipt.digest"),
        ({"trace_context": {"traceparent": 3}}, "trace_context"),
    ],
)
def test_invalid_descriptor_fields_are_named(changes: dict[str, object], field: str) -> None:
    with pytest.raises(DescriptorInvalid) as caught:
        _descriptor(**changes)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("route", "field"),
    [
        (("10.0.0.7", "gloo", 1, "5" * 64), "rendezvous_address"),
        (("10.0.0.7:70000", "gloo", 1, "5" * 64), "rendezvous_address"),
        (("10.0.0.7:29500", "mpi", 1, "5" * 64), "rendezvous_address.backend"),
        (("10.0.0.7:29500", "gloo", 0, "5" * 64), "rendezvous_address.epoch"),
        (("10.0.0.7:29500", "gloo", 1, ""), "rendezvous_secret"),
        (("10.0.0.7:29500", "gloo", 1, "5" * 63), "rendezvous_secret"),
        (("10.0.0.7:29500", "gloo", 1, "A" * 64), "rendezvous_secret"),
    ],
)
def test_invalid_routes_are_named(route: tuple[str, str, int, str], field: str) -> None:
    with pytest.raises(DescriptorInvalid) as caught:
        PairRoute(*route)
    assert caught.value.field == field


def test_malformed_wire_descriptors_are_rejected_naming_the_field() -> None:
    message = descriptor_to_proto(_descriptor())
    cases = {
        "receipt.digest": lambda m: setattr(m.receipt, "digest", "ABC"),
        "tensors[3].nbytes": lambda m: setattr(m.tensors[3], "nbytes", 1),
        "tensors[2].dtype": lambda m: setattr(m.tensors[2], "dtype", "nonsense"),
        "tensors[7]": _shrink_packed_v_of_layer_1,
        "tensors[5].shape": lambda m: m.tensors[5].shape.append(1),
        "tensors": lambda m: m.tensors.pop(),
        "rendezvous_address": lambda m: setattr(m, "rendezvous_address", "10.0.0.7:29500"),
        "rendezvous_secret": lambda m: setattr(m, "rendezvous_secret", ""),
    }
    for field, corrupt in cases.items():
        broken = type(message).FromString(message.SerializeToString())
        corrupt(broken)
        with pytest.raises(DescriptorInvalid) as caught:
            descriptor_from_proto(broken)
        assert caught.value.field == field, field


def _shrink_packed_v_of_layer_1(message) -> None:  # type: ignore[no-untyped-def]
    """A self-consistent spec (shape and nbytes agree) that contradicts packed_k[1]."""
    spec = message.tensors[7]
    spec.shape[0] -= 1
    spec.nbytes = spec.shape[0] * spec.shape[1] * 2


def test_layout_validation_names_the_field() -> None:
    with pytest.raises(DescriptorInvalid, match="layout.layer_rows"):
        ViewLayout((), 2, 8, torch.float16, torch.float16)
    with pytest.raises(DescriptorInvalid, match=r"layout.layer_rows\[1\]"):
        ViewLayout((3, -1), 2, 8, torch.float16, torch.float16)
    with pytest.raises(DescriptorInvalid, match="layout.k_dtype"):
        ViewLayout((3,), 2, 8, "float16", torch.float16)  # type: ignore[arg-type]


def test_deadline_bounds_and_converts() -> None:
    deadline = Deadline.after(0.05)
    assert 0 < deadline.remaining() <= 0.05 and not deadline.expired()
    time.sleep(0.06)
    assert deadline.expired() and deadline.remaining() == 0.0
    assert deadline.timedelta() == datetime.timedelta(milliseconds=1)
    with pytest.raises(ValueError, match="seconds"):
        Deadline.after(-1)


def test_the_route_secret_crosses_the_wire_but_never_shows_in_repr() -> None:
    descriptor = _descriptor()
    message = descriptor_to_proto(descriptor)
    assert message.rendezvous_secret == descriptor.route.secret == "5" * 64
    assert descriptor_from_proto(message).route == descriptor.route
    assert "5" * 64 not in repr(descriptor) and "5" * 64 not in str(descriptor.route)
