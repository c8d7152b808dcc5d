"""How recalled rows travel: the typed values of `kvrelay.v1.OffloadService` and the packing
of recalled pages into a view.

    decode worker                                  prefill worker (offload tier)
    Recall(RecallCall)           ── gRPC ──▶       check fence, fetch pages from the store,
                                 ◀── gRPC ──       RecallAnswer(pages, missing, descriptor)
    receiver.start_recv(descriptor)                sender.start_send(descriptor) ... wait
    pages_of_view(view, answer)  ◀── pair group ── recall_view(pages)

Recalled pages travel as a packed view (one segment per (layer, owner), rows ascending by
original position), so they use the main transfer's own pair groups, sender, receiver, tags
and byte accounting: the prefill worker is rank 0, the decode worker rank 1, and the pair
group is the (reused, idle) one between them, or a new one at the decode worker's store.
A caller without a pair group asks `inline`: the rows come back in the answer instead.

`recall_digest` binds the request, both generations and every recalled position to the
descriptor, so the decode worker checks that the rows it received are the ones answered.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.kvpolicy.packing import OFFSET_DTYPE, POSITION_DTYPE, PackedKVView
from services.offload.merge import merge_view
from services.offload.pages import PageRef, RecalledPage
from services.rpc.kvrelay.v1 import common_pb2, offload_pb2
from services.transfer.codec import descriptor_from_proto, descriptor_to_proto
from services.transfer.descriptor import TransferDescriptor
from services.transfer.errors import DescriptorInvalid
from services.transfer.layout import dtype_from_name, dtype_name

RECALL_DOMAIN = "kvrelay.recall.v1"
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class RecallCall:
    """One Recall request: which pages of which offloaded state, built on which parent state,
    and where the rows go (`rendezvous_address` of the caller's pair-group store, or inline)."""

    request_id: str
    request_generation: int
    parent_state_generation: int
    handoff_id: str
    pages: tuple[PageRef, ...]
    rendezvous_address: str = ""
    inline: bool = False
    trace_context: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.request_id:
            raise DescriptorInvalid("request_id", "must not be empty")
        if self.request_generation < 1:
            raise DescriptorInvalid("request_generation", f"{self.request_generation} must be >= 1")
        if self.parent_state_generation < 1:
            raise DescriptorInvalid(
                "parent_state_generation", f"{self.parent_state_generation} must be >= 1"
            )
        if not self.handoff_id:
            raise DescriptorInvalid("handoff_id", "must not be empty")
        if not self.pages:
            raise DescriptorInvalid("pages", "a recall asks for at least one page")
        if len(set(self.pages)) != len(self.pages):
            raise DescriptorInvalid("pages", "a page is asked for twice")
        for i, ref in enumerate(self.pages):
            if min(ref.layer, ref.owner, ref.page_index) < 0:
                raise DescriptorInvalid(f"pages[{i}]", f"{ref} has a negative index")
        if not self.inline and not _is_host_port(self.rendezvous_address):
            raise DescriptorInvalid(
                "rendezvous_address",
                f"{self.rendezvous_address!r} is not host:port (or ask for inline rows)",
            )


@dataclass(frozen=True)
class PageRows:
    """One answered page: its reference and how many rows it has."""

    ref: PageRef
    rows: int


@dataclass(frozen=True)
class RecallAnswer:
    """What a Recall returns. `pages` are in travel order (layer, owner, page index);
    `transfer` announces the pair-group transfer of their rows, `inline` carries them instead."""

    request_generation: int
    parent_state_generation: int
    pages: tuple[PageRows, ...]
    missing: tuple[PageRef, ...]
    nbytes: int
    transfer: TransferDescriptor | None = None
    inline: tuple[RecalledPage, ...] = ()

    @property
    def rows(self) -> int:
        return sum(page.rows for page in self.pages)


def travel_order(pages: Sequence[RecalledPage]) -> tuple[RecalledPage, ...]:
    """Pages sorted the way their rows travel: by layer, owner, then page index."""
    return tuple(sorted(pages, key=lambda p: (p.ref.layer, p.ref.owner, p.ref.page_index)))


def recall_view(pages: Sequence[RecalledPage], num_layers: int, num_owners: int) -> PackedKVView:
    """The recalled pages as one packed view (rows of a (layer, owner) ascending by position)."""
    if not pages:
        raise DescriptorInvalid("pages", "nothing to pack")
    first = pages[0]
    empty = PackedKVView(
        packed_k=first.k.new_empty(0, first.k.shape[1]),
        packed_v=first.v.new_empty(0, first.v.shape[1]),
        original_position_map=torch.empty(0, dtype=POSITION_DTYPE),
        row_offsets=torch.zeros(num_layers, num_owners + 1, dtype=OFFSET_DTYPE),
    )
    return merge_view(empty, list(pages))


def pages_of_view(view: PackedKVView, pages: Sequence[PageRows]) -> tuple[RecalledPage, ...]:
    """Split a received recall view back into its pages (`pages` in travel order); every
    (layer, owner) segment must hold exactly its pages' rows."""
    out: list[RecalledPage] = []
    cursor: dict[tuple[int, int], int] = {}
    for i, page in enumerate(pages):
        segment = (page.ref.layer, page.ref.owner)
        if not (0 <= segment[0] < view.num_layers and 0 <= segment[1] < view.num_kv_heads):
            raise DescriptorInvalid(f"pages[{i}]", f"{page.ref} lies outside the received view")
        rows = view.rows(*segment)
        start = cursor.get(segment, rows.start)
        stop = start + page.rows
        if stop > rows.stop:
            raise DescriptorInvalid(f"pages[{i}].rows", f"the view holds fewer rows for {segment}")
        cursor[segment] = stop
        out.append(RecalledPage(
            ref=page.ref,
            positions=view.original_position_map[start:stop].cpu(),
            k=view.packed_k[start:stop],
            v=view.packed_v[start:stop],
        ))
    if sum(page.rows for page in pages) != view.total_rows:
        raise DescriptorInvalid("pages", f"answered rows differ from the {view.total_rows} received")
    return tuple(out)


def recall_digest(
    request_id: str, request_generation: int, parent_state_generation: int, pages: Sequence[RecalledPage]
) -> str:
    """SHA-256 hex over the request, both generations and every page's reference and positions."""
    body = {
        "domain": RECALL_DOMAIN,
        "request_id": request_id,
        "request_generation": request_generation,
        "parent_state_generation": parent_state_generation,
        "pages": [
            [p.ref.layer, p.ref.owner, p.ref.page_index, [int(x) for x in p.positions.tolist()]]
            for p in pages
        ],
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --- protobuf, converted once ------------------------------------------------------------


def call_to_proto(call: RecallCall) -> offload_pb2.RecallRequest:
    return offload_pb2.RecallRequest(
        request_id=call.request_id,
        request_generation=call.request_generation,
        parent_state_generation=call.parent_state_generation,
        handoff_id=call.handoff_id,
        pages=[ref_to_proto(ref) for ref in call.pages],
        trace_context=dict(call.trace_context),
        rendezvous_address=call.rendezvous_address,
        inline=call.inline,
    )


def call_from_proto(message: offload_pb2.RecallRequest) -> RecallCall:
    """Parse a RecallRequest; DescriptorInvalid names the first bad field."""
    return RecallCall(
        request_id=message.request_id,
        request_generation=message.request_generation,
        parent_state_generation=message.parent_state_generation,
        handoff_id=message.handoff_id,
        pages=tuple(ref_from_proto(ref, f"pages[{i}]") for i, ref in enumerate(message.pages)),
        rendezvous_address=message.rendezvous_address,
        inline=message.inline,
        trace_context=tuple(sorted(message.trace_context.items())),
    )


def answer_to_proto(answer: RecallAnswer) -> offload_pb2.RecallResponse:
    inline = {page.ref: page for page in answer.inline}
    message = offload_pb2.RecallResponse(
        pages=[_page_to_proto(page, inline.get(page.ref)) for page in answer.pages],
        missing=[ref_to_proto(ref) for ref in answer.missing],
        bytes=answer.nbytes,
        generations=common_pb2.Generations(
            request_generation=answer.request_generation,
            parent_state_generation=answer.parent_state_generation,
        ),
    )
    if answer.transfer is not None:
        message.transfer.CopyFrom(descriptor_to_proto(answer.transfer))
    return message


def answer_from_proto(message: offload_pb2.RecallResponse) -> RecallAnswer:
    """Parse a RecallResponse; DescriptorInvalid names the first bad field."""
    pages = tuple(
        PageRows(ref_from_proto(page.page, f"pages[{i}].page"), _rows(page.rows, f"pages[{i}].rows"))
        for i, page in enumerate(message.pages)
    )
    inline = tuple(
        _page_from_proto(page, rows, f"pages[{i}]")
        for i, (page, rows) in enumerate(zip(message.pages, pages, strict=True))
        if page.k
    )
    if inline and len(inline) != len(pages):
        raise DescriptorInvalid("pages", "some pages carry rows inline and some do not")
    return RecallAnswer(
        request_generation=message.generations.request_generation,
        parent_state_generation=message.generations.parent_state_generation,
        pages=pages,
        missing=tuple(ref_from_proto(ref, f"missing[{i}]") for i, ref in enumerate(message.missing)),
        nbytes=message.bytes,
        transfer=descriptor_from_proto(message.transfer) if message.HasField("transfer") else None,
        inline=inline,
    )


def ref_to_proto(ref: PageRef) -> offload_pb2.PageRef:
    return offload_pb2.PageRef(layer=ref.layer, kv_head=ref.owner, page_index=ref.page_index)


def ref_from_proto(message: offload_pb2.PageRef, field: str) -> PageRef:
    if min(message.layer, message.kv_head, message.page_index) < 0:
        raise DescriptorInvalid(field, "layer, kv_head and page_index must be non-negative")
    return PageRef(message.layer, message.kv_head, message.page_index)


def _page_to_proto(page: PageRows, rows: RecalledPage | None) -> offload_pb2.RecalledPage:
    message = offload_pb2.RecalledPage(page=ref_to_proto(page.ref), rows=page.rows)
    if rows is not None:
        message.positions.extend(int(p) for p in rows.positions.tolist())
        message.k = _tensor_bytes(rows.k)
        message.v = _tensor_bytes(rows.v)
        message.dtype = dtype_name(rows.k.dtype)
        message.v_dtype = dtype_name(rows.v.dtype) if rows.v.dtype != rows.k.dtype else ""
        message.head_dim = int(rows.k.shape[1])
    return message


def _page_from_proto(message: offload_pb2.RecalledPage, page: PageRows, field: str) -> RecalledPage:
    k_dtype = dtype_from_name(message.dtype, f"{field}.dtype")
    v_dtype = dtype_from_name(message.v_dtype, f"{field}.v_dtype") if message.v_dtype else k_dtype
    shape = (page.rows, message.head_dim)
    if message.head_dim < 1:
        raise DescriptorInvalid(f"{field}.head_dim", f"{message.head_dim} must be positive")
    for name, data, dtype in (("k", message.k, k_dtype), ("v", message.v, v_dtype)):
        if len(data) != page.rows * message.head_dim * dtype.itemsize:
            raise DescriptorInvalid(f"{field}.{name}", f"{len(data)} bytes is not {shape} {dtype_name(dtype)}")
    if len(message.positions) != page.rows:
        raise DescriptorInvalid(f"{field}.positions", f"expected {page.rows} positions")
    return RecalledPage(
        ref=page.ref,
        positions=torch.tensor(list(message.positions), dtype=POSITION_DTYPE),
        k=_tensor_from_bytes(message.k, k_dtype, shape),
        v=_tensor_from_bytes(message.v, v_dtype, shape),
    )


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _rows(value: int, field: str) -> int:
    if not 1 <= value <= _INT32_MAX:
        raise DescriptorInvalid(field, f"{value} must be a positive row count")
    return value


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and "/" not in host and port.isdigit() and 0 < int(port) < 65536
