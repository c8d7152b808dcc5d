"""The sidecar of a recallable manifest's transfer: page summaries (and, for recallable_local,
the omitted rows) travel after the view's layers over the same real gloo pair group, arrive
exactly, and the bytes moved equal the ledger's traffic (view, metadata, summaries, rows).
Summaries with row codes (a manifest's `key_code_bits`) carry one more message, `row_codes`,
counted with the summaries; without codes there is no such message."""

from __future__ import annotations

import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from kv_helpers import symbolic_kv

from services.kvpolicy.ledger import build_ledger
from services.kvpolicy.manifest import DType, TensorContract
from services.kvpolicy.packing import pack
from services.offload.pages import gather_omitted, summarize_pages, unpack_codes, with_value_means
from services.transfer import (
    Deadline,
    DescriptorInvalid,
    KVReceiver,
    KVSender,
    Sidecar,
    SidecarLayout,
    TransferDescriptor,
    TransferKey,
    TransferMismatch,
    ViewLayout,
    layer_of,
)
from services.transfer.codec import descriptor_from_proto, descriptor_to_proto
from services.transfer.descriptor import PairRoute
from services.transfer.sidecar import sidecar_from_buffers

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)
LAYERS, HEADS, TOKENS, HEAD_DIM, PAGE = 2, 2, 20, 8, 3
SELECTED = [[[0, 1, 9, 19], [0, 19]], [[2, 3, 4, 5, 19], [0, 6, 12, 19]]]
CONTRACT = TensorContract(LAYERS, 4, HEADS, HEAD_DIM, DType.FLOAT32, DType.FLOAT32)


@pytest.fixture
def pair():
    receiver, sender = KVReceiver(), KVSender(f"prefill-{uuid.uuid4().hex[:6]}")
    yield receiver, sender
    sender.close()
    receiver.close()


def sidecar(local: bool, code_bits: int = 0, values: bool = False) -> tuple[Sidecar, torch.Tensor, torch.Tensor]:
    k, v = symbolic_kv(LAYERS, HEADS, TOKENS, HEAD_DIM)
    summaries = summarize_pages(k, SELECTED, PAGE, code_bits=code_bits)
    rows = gather_omitted(k, v, summaries)
    if values:
        summaries = with_value_means(summaries, rows)
    return Sidecar(summaries, rows if local else None), k, v


def describe(sender: KVSender, address: str, car: Sidecar, view_k: torch.Tensor, view_v: torch.Tensor):
    view = pack(view_k, view_v, SELECTED)
    key = TransferKey("req-sidecar", 1, 1, uuid.uuid4().hex[:8])
    deadline = Deadline.after(20.0)
    lease = sender.reserve(key, address, "cpu", deadline)
    descriptor = TransferDescriptor(
        transfer_id=key.transfer_id, request_id=key.request_id, request_generation=1, state_generation=1,
        cache_generation=1, receipt_digest="0" * 64, source_worker=sender.worker_id, route=lease.route,
        layout=ViewLayout.of(view), sidecar=SidecarLayout.of(car, view.packed_v.dtype),
    )
    return view, descriptor, lease, deadline


@pytest.mark.parametrize(
    ("local", "code_bits", "values"),
    [(False, 0, False), (True, 0, False), (False, 1, False), (True, 2, False), (True, 4, False),
     (False, 4, False), (False, 4, True), (True, 2, True)],
    ids=["remote", "local", "remote-1bit", "local-2bit", "local-4bit", "remote-4bit",
         "remote-4bit-values", "local-2bit-values"],
)
def test_summaries_and_host_rows_arrive_exactly_and_bytes_equal_the_ledger(
    pair, local: bool, code_bits: int, values: bool
) -> None:
    receiver, sender = pair
    car, k, v = sidecar(local, code_bits, values)
    view, descriptor, lease, deadline = describe(sender, receiver.address, car, k, v)
    message = descriptor_to_proto(descriptor)
    assert ("row_codes" in [t.name for t in message.tensors]) == bool(code_bits)
    assert ("page_value_mean" in [t.name for t in message.tensors]) == values
    wire = descriptor_from_proto(message)
    assert wire == descriptor and wire.nbytes == descriptor.nbytes
    assert wire.sidecar is not None and wire.sidecar.code_bits == code_bits

    incoming = receiver.start_recv(wire, deadline)
    outgoing = sender.start_send(descriptor, lease, deadline)
    for layer in range(view.num_layers):
        outgoing.send_layer(layer_of(view, layer))
    outgoing.send_sidecar(car)
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(outgoing.wait_for_send, deadline)
        incoming.wait_for_view(deadline)
        got = incoming.wait_for_sidecar(deadline)
        moved = sent.result(timeout=20)

    assert got is not None
    summaries = got.summaries
    for name in ("page_min", "page_max", "page_first", "page_count", "page_offsets"):
        assert torch.equal(getattr(summaries, name), getattr(car.summaries, name)), name
    assert summaries.code_bits == code_bits
    if code_bits:
        assert summaries.row_codes is not None and car.summaries.row_codes is not None
        assert torch.equal(summaries.row_codes, car.summaries.row_codes)
        # Independent of the codec: symbolic keys step by 10 a position inside a page, so
        # every row's code is its rank in its page scaled to 2^b - 1 levels.
        first = summaries.page_first.long()[summaries.row_page]
        count = summaries.page_count.long()[summaries.row_page]
        _, positions = summaries.rows()
        rank = (positions - first).float() / (count - 1).clamp(min=1).float()
        expected = torch.round(rank * (2**code_bits - 1))[:, None].expand(-1, HEAD_DIM)
        assert torch.equal(unpack_codes(summaries.row_codes, code_bits, HEAD_DIM).float(), expected)
    else:
        assert summaries.row_codes is None
    if values:
        # Independent of the codec: symbolic V = K + 5000, so at coordinate 0 a page's mean is
        # 5000 + 1000 layer + 100 owner + 10 x the mean of its positions.
        assert summaries.page_value_mean is not None
        segment, positions = summaries.rows()
        page = summaries.row_page
        mean_position = torch.zeros(summaries.num_pages).index_add_(0, page, positions.float())
        mean_position /= summaries.page_count.float()
        owner_of_page = summaries.page_segment
        expected = 5000 + 1000.0 * (owner_of_page // HEADS) + 100 * (owner_of_page % HEADS) + 10 * mean_position
        assert torch.allclose(summaries.page_value_mean[:, 0], expected)
        assert torch.equal(summaries.page_value_mean, car.summaries.page_value_mean)
    else:
        assert summaries.page_value_mean is None
    if local:
        assert got.host_rows is not None
        segment, positions = summaries.rows()
        layer, owner = segment // HEADS, segment % HEADS
        expected = 1000.0 * layer + 100 * owner + 10 * positions  # [N] symbolic K at c = 0
        assert torch.equal(got.host_rows.k[:, 0], expected.float())
        assert torch.equal(got.host_rows.v, got.host_rows.k + 5000)
        assert torch.equal(got.host_rows.positions.long(), positions)
    else:
        assert got.host_rows is None

    ledger = build_ledger(CONTRACT, TOKENS, SELECTED)
    ledger = car.charge(ledger)
    assert moved == incoming.bytes_moved == descriptor.nbytes == ledger.traffic_bytes
    assert ledger.page_summary_bytes == descriptor.sidecar.page_summary_bytes > 0
    assert (ledger.host_tier_bytes > 0) == local
    uncoded = summarize_pages(k, SELECTED, PAGE).nbytes
    code_bytes = car.summaries.omitted_rows * HEAD_DIM * code_bits // 8
    mean_bytes = car.summaries.num_pages * HEAD_DIM * 4 if values else 0
    assert ledger.page_summary_bytes == uncoded + code_bytes + mean_bytes


def test_a_sidecar_that_is_not_the_announced_one_is_refused(pair) -> None:
    receiver, sender = pair
    car, k, v = sidecar(local=False)
    _view, descriptor, lease, deadline = describe(sender, receiver.address, car, k, v)
    transfer = sender.start_send(descriptor, lease, deadline)
    try:
        other = replace(car.summaries, page_size=PAGE + 1)
        with pytest.raises(TransferMismatch) as caught:
            transfer.send_sidecar(Sidecar(other))
        assert caught.value.field == "page_size"
        local, _, _ = sidecar(local=True)
        with pytest.raises(TransferMismatch) as extra:
            transfer.send_sidecar(local)
        assert extra.value.field == "sidecar"
    finally:
        transfer.cancel("test over")


def unsent_descriptor(local: bool, code_bits: int = 0) -> tuple[Sidecar, TransferDescriptor]:
    """A sidecar and a descriptor announcing it, on a route nobody listens on (never sent)."""
    car, k, v = sidecar(local, code_bits)
    view = pack(k, v, SELECTED)
    route = PairRoute("127.0.0.1:1234", "gloo", 7, "5" * 64)
    descriptor = TransferDescriptor(
        transfer_id="t1", request_id="req-1", request_generation=1, state_generation=1,
        cache_generation=1, receipt_digest="0" * 64, source_worker="prefill-x", route=route,
        layout=ViewLayout.of(view), sidecar=SidecarLayout.of(car, view.packed_v.dtype),
    )
    return car, descriptor


def test_a_descriptor_with_summaries_needs_a_page_size() -> None:
    _car, descriptor = unsent_descriptor(local=False)
    message = descriptor_to_proto(descriptor)
    assert message.page_size == PAGE
    message.page_size = 0
    with pytest.raises(DescriptorInvalid) as caught:
        descriptor_from_proto(message)
    assert caught.value.field == "page_size"
    del message.tensors[-1]  # page_max: the sidecar is no longer the one its specs describe
    message.page_size = PAGE
    with pytest.raises(DescriptorInvalid) as truncated:
        descriptor_from_proto(message)
    assert truncated.value.field.startswith("tensors")


@pytest.mark.parametrize(
    ("reshape", "dtype", "field"),
    [
        (None, "int8", "tensors.row_codes.dtype"),
        (lambda rows, width: [rows, 3], None, "tensors.row_codes.shape"),  # 3 bytes: no bit count
        (lambda rows, width: [rows, width, 1], None, "tensors.row_codes.shape"),
        (lambda rows, width: [rows + 1, width], None, "sidecar.coded_rows"),  # > host rows
    ],
    ids=["dtype", "width", "rank", "rows"],
)
def test_a_descriptor_whose_row_codes_are_not_codes_is_refused_naming_them(
    reshape, dtype, field
) -> None:
    _car, descriptor = unsent_descriptor(local=True, code_bits=2)
    message = descriptor_to_proto(descriptor)
    assert descriptor_from_proto(message) == descriptor
    spec = next(t for t in message.tensors if t.name == "row_codes")
    if reshape is not None:
        dims = reshape(*spec.shape)
        del spec.shape[:]
        spec.shape.extend(dims)
    if dtype is not None:
        spec.dtype = dtype
    itemsize = torch.empty(0, dtype=getattr(torch, spec.dtype)).element_size()
    spec.nbytes = math.prod(spec.shape) * itemsize  # consistent, so only the codes' check refuses
    with pytest.raises(DescriptorInvalid) as caught:
        descriptor_from_proto(message)
    assert caught.value.field == field


def test_row_codes_the_descriptor_does_not_announce_are_refused(pair) -> None:
    receiver, sender = pair
    car, k, v = sidecar(local=False, code_bits=2)
    _view, descriptor, lease, deadline = describe(sender, receiver.address, car, k, v)
    transfer = sender.start_send(descriptor, lease, deadline)
    try:
        uncoded, _, _ = sidecar(local=False)
        with pytest.raises(TransferMismatch) as missing:
            transfer.send_sidecar(uncoded)  # no row_codes message
        assert missing.value.field == "sidecar"
        wider, _, _ = sidecar(local=False, code_bits=4)
        with pytest.raises(TransferMismatch) as other_bits:
            transfer.send_sidecar(wider)
        assert other_bits.value.field == "code_bits"
    finally:
        transfer.cancel("test over")


def test_received_codes_that_do_not_fit_the_pages_are_refused() -> None:
    """The descriptor cannot know the remote summaries' row count; the received summaries do."""
    car, descriptor = unsent_descriptor(local=False, code_bits=4)
    layout = descriptor.sidecar
    assert layout is not None
    short = replace(layout, coded_rows=layout.coded_rows - 1)
    buffers = {name: tensor.clone() for name, tensor in car.tensors().items()}
    buffers["row_codes"] = buffers["row_codes"][:-1]
    with pytest.raises(TransferMismatch) as caught:
        sidecar_from_buffers(short, buffers, TransferKey("req-1", 1, 1, "t1"))
    assert caught.value.field == "sidecar.row_codes"
    whole = sidecar_from_buffers(layout, dict(car.tensors()), TransferKey("req-1", 1, 1, "t1"))
    assert whole.summaries.code_bits == 4


def test_page_value_means_are_announced_only_with_codes_and_sent_only_when_announced(pair) -> None:
    with pytest.raises(DescriptorInvalid) as bare:
        SidecarLayout(LAYERS, HEADS, 4, HEAD_DIM, PAGE, torch.float32, torch.float32,
                      value_means=True)
    assert bare.value.field == "sidecar.page_value_mean"
    receiver, sender = pair
    car, k, v = sidecar(local=False, code_bits=4)
    valued, _, _ = sidecar(local=False, code_bits=4, values=True)
    _view, descriptor, lease, deadline = describe(sender, receiver.address, car, k, v)
    assert "page_value_mean" not in [s.name for s in descriptor.sidecar.specs()]
    transfer = sender.start_send(descriptor, lease, deadline)
    try:
        with pytest.raises(TransferMismatch) as extra:
            transfer.send_sidecar(valued)  # means the descriptor does not announce
        assert extra.value.field == "sidecar"
    finally:
        transfer.cancel("test over")
