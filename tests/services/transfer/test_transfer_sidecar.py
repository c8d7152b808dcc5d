"""The sidecar of a recallable manifest's transfer: page summaries (and, for recallable_local,
the omitted rows) travel after the view's layers over the same real gloo pair group, arrive
exactly, and the bytes moved equal the ledger's traffic (view, metadata, summaries, rows)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from kv_helpers import symbolic_kv

from services.kvpolicy.ledger import build_ledger, with_host_tier, with_page_summaries
from services.kvpolicy.manifest import DType, TensorContract
from services.kvpolicy.packing import pack
from services.offload.pages import gather_omitted, summarize_pages
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

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)
LAYERS, HEADS, TOKENS, HEAD_DIM, PAGE = 2, 2, 20, 4, 3
SELECTED = [[[0, 1, 9, 19], [0, 19]], [[2, 3, 4, 5, 19], [0, 6, 12, 19]]]
CONTRACT = TensorContract(LAYERS, 4, HEADS, HEAD_DIM, DType.FLOAT32, DType.FLOAT32)


@pytest.fixture
def pair():
    receiver, sender = KVReceiver(), KVSender(f"prefill-{uuid.uuid4().hex[:6]}")
    yield receiver, sender
    sender.close()
    receiver.close()


def sidecar(local: bool) -> tuple[Sidecar, torch.Tensor, torch.Tensor]:
    k, v = symbolic_kv(LAYERS, HEADS, TOKENS, HEAD_DIM)
    summaries = summarize_pages(k, SELECTED, PAGE)
    return Sidecar(summaries, gather_omitted(k, v, summaries) if local else None), k, v


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


@pytest.mark.parametrize("local", [False, True], ids=["remote", "local"])
def test_summaries_and_host_rows_arrive_exactly_and_bytes_equal_the_ledger(pair, local: bool) -> None:
    receiver, sender = pair
    car, k, v = sidecar(local)
    view, descriptor, lease, deadline = describe(sender, receiver.address, car, k, v)
    wire = descriptor_from_proto(descriptor_to_proto(descriptor))
    assert wire == descriptor and wire.nbytes == descriptor.nbytes

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
    ledger = with_host_tier(with_page_summaries(ledger, car.summaries.nbytes), car.host_tier_bytes)
    assert moved == incoming.bytes_moved == descriptor.nbytes == ledger.traffic_bytes
    assert ledger.page_summary_bytes == descriptor.sidecar.page_summary_bytes > 0
    assert (ledger.host_tier_bytes > 0) == local


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


def test_a_descriptor_with_summaries_needs_a_page_size() -> None:
    car, k, v = sidecar(local=False)
    view = pack(k, v, SELECTED)
    descriptor = TransferDescriptor(
        transfer_id="t1", request_id="req-1", request_generation=1, state_generation=1, cache_generation=1,
        receipt_digest="0" * 64, source_worker="prefill-x", route=PairRoute("127.0.0.1:1234", "gloo", 7, "5" * 64),
        layout=ViewLayout.of(view), sidecar=SidecarLayout.of(car),
    )
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
