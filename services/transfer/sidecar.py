"""What travels after a view's layers for a recallable manifest: the page summaries of the
omitted rows and, for `recallable_local`, the omitted rows themselves (bound for the decode
worker's host tier, not its attention cache). In send order:

    page_offsets       [L, H + 1]     int32     \\
    page_first         [P]            int32      |
    page_count         [P]            int32      |  PageSummaries: the ledger's
    page_min           [P, d_h]       K dtype    |  page_summary_bytes
    page_max           [P, d_h]       K dtype    |
    row_codes          [N, d_h b / 8] uint8      |  (only when the summaries carry b-bit codes)
    page_value_mean    [P, d_h]       V dtype   /   (only with `omitted_value_term`)
    omitted_k          [N, d_h]       K dtype   \\
    omitted_v          [N, d_h]       V dtype    |  host tier (recallable_local only): the
    omitted_positions  [N]            int32      |  ledger's host_tier_bytes
    page_rows          [P + 1]        int32     /

The summaries travel over the pair group, not inside the gRPC descriptor, because they grow
with the omitted rows: P is about omitted rows / page_size, each page two d_h-wide key rows,
so a long prompt's summaries (an 8B model at 32K context with 16-row pages: ~200 MB) are far
past a gRPC message, while on the pair group they are bytes moved like the view's own
metadata, counted by the same ledger. The row codes (`key_code_bits` b of the manifest:
1, 2 or 4) are N rows of d_h b-bit codes, one per omitted row page after page; b is read
back from their width, so the descriptor needs no field of its own; the page value means
(the manifest's `omitted_value_term`) are there or not, and verify holds them to the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.kvpolicy.ledger import Ledger, with_host_tier, with_page_summaries
from services.offload.errors import OffloadError
from services.offload.pages import CODE_BITS, PAGE_INDEX_DTYPE, OmittedRows, PageSummaries
from services.transfer.errors import DescriptorInvalid, TransferKey, TransferMismatch
from services.transfer.layout import (
    MAX_LAYERS,
    WIRE_FIELDS,
    TensorSpec,
    dtype_from_name,
    dtype_name,
)

PAGE_FIELDS = ("page_offsets", "page_first", "page_count", "page_min", "page_max")
# row_codes: only with code bits; page_value_mean: only with the omitted value term
SUMMARY_FIELDS = (*PAGE_FIELDS, "row_codes", "page_value_mean")
CODE_DTYPE = torch.uint8  # packed row codes, 8 / b codes a byte
HOST_TIER_FIELDS = ("omitted_k", "omitted_v", "omitted_positions", "page_rows")
SIDECAR_FIELDS = SUMMARY_FIELDS + HOST_TIER_FIELDS
# Tags after every possible view message (`wire_tag` stays below MAX_LAYERS * 4).
_TAG_BASE = MAX_LAYERS * len(WIRE_FIELDS)


def sidecar_tag(field: str) -> int:
    """Message tag of one sidecar tensor (distinct from every view message's tag)."""
    return _TAG_BASE + SIDECAR_FIELDS.index(field)


@dataclass(frozen=True)
class Sidecar:
    """The sidecar of one transfer: page summaries, and the host-tier rows when local."""

    summaries: PageSummaries
    host_rows: OmittedRows | None = None

    @property
    def host_tier_bytes(self) -> int:
        """Bytes of the host-tier rows as they travel (their page offsets go with the summaries)."""
        if self.host_rows is None:
            return 0
        rows = self.host_rows
        return sum(_nbytes(t) for t in (rows.k, rows.v, rows.positions, rows.page_rows))

    @property
    def nbytes(self) -> int:
        return self.summaries.nbytes + self.host_tier_bytes

    def charge(self, ledger: Ledger) -> Ledger:
        """`ledger` charged with this sidecar: the summaries and host-tier rows that travel,
        and the codes table the decode worker will hold for them."""
        s = self.summaries
        return with_host_tier(with_page_summaries(ledger, s.nbytes, s.code_table_bytes),
                              self.host_tier_bytes)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor that travels, by wire name, in send order."""
        s = self.summaries
        out = {
            "page_offsets": s.page_offsets,
            "page_first": s.page_first,
            "page_count": s.page_count,
            "page_min": s.page_min,
            "page_max": s.page_max,
        }
        if s.row_codes is not None:
            out["row_codes"] = s.row_codes
        if s.page_value_mean is not None:
            out["page_value_mean"] = s.page_value_mean
        if self.host_rows is not None:
            rows = self.host_rows
            out.update(omitted_k=rows.k, omitted_v=rows.v, omitted_positions=rows.positions,
                       page_rows=rows.page_rows)
        return out


@dataclass(frozen=True)
class SidecarLayout:
    """Shapes of a sidecar on the wire: pages, layers, owners, head dim, dtypes, page size,
    the host-tier row count (None: no host tier, `recallable_remote`) and the row codes' bits
    and rows (0 and 0: no codes; with a host tier, one code row per host row), and whether
    the page value means travel (only with codes)."""

    num_layers: int
    num_owners: int
    num_pages: int
    head_dim: int
    page_size: int
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    host_rows: int | None = None
    code_bits: int = 0
    coded_rows: int = 0
    value_means: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_owners", "head_dim", "page_size"):
            _count(f"sidecar.{name}", getattr(self, name), minimum=1)
        _count("sidecar.num_pages", self.num_pages, minimum=0)
        if self.num_layers > MAX_LAYERS:
            raise DescriptorInvalid("sidecar.num_layers", f"{self.num_layers} exceeds {MAX_LAYERS}")
        if self.host_rows is not None:
            _count("sidecar.host_rows", self.host_rows, minimum=0)
        self._check_codes()

    def _check_codes(self) -> None:
        bits, rows = self.code_bits, self.coded_rows
        if isinstance(bits, bool) or bits not in (0, *CODE_BITS):
            reason = f"must be 0 or one of {CODE_BITS}, got {bits!r}"
            raise DescriptorInvalid("sidecar.code_bits", reason)
        if self.head_dim * bits % 8:
            reason = f"{bits}-bit codes of d_h = {self.head_dim} are not whole bytes"
            raise DescriptorInvalid("sidecar.code_bits", reason)
        _count("sidecar.coded_rows", rows, minimum=0)
        if bits == 0 and rows:
            raise DescriptorInvalid("sidecar.coded_rows", f"{rows} code rows without code bits")
        if rows > self.num_pages * self.page_size:  # before any buffer is allocated for them
            reason = f"{rows} code rows exceed {self.num_pages} pages of {self.page_size} rows"
            raise DescriptorInvalid("sidecar.coded_rows", reason)
        if bits and self.host_rows is not None and rows != self.host_rows:
            reason = f"{rows} code rows for {self.host_rows} host rows"
            raise DescriptorInvalid("sidecar.coded_rows", reason)
        if self.value_means and not bits:
            raise DescriptorInvalid("sidecar.page_value_mean", "page value means without row codes")

    @classmethod
    def of(cls, sidecar: Sidecar, v_dtype: torch.dtype | None = None) -> SidecarLayout:
        s = sidecar.summaries
        rows = sidecar.host_rows
        if rows is None and s.page_value_mean is not None:
            v_dtype = s.page_value_mean.dtype
        return cls(
            num_layers=s.num_layers,
            num_owners=s.num_owners,
            num_pages=s.num_pages,
            head_dim=s.head_dim,
            page_size=s.page_size,
            k_dtype=s.page_min.dtype,
            v_dtype=rows.v.dtype if rows is not None else (v_dtype or s.page_min.dtype),
            host_rows=rows.num_rows if rows is not None else None,
            code_bits=s.code_bits,
            coded_rows=int(s.row_codes.shape[0]) if s.row_codes is not None else 0,
            value_means=s.page_value_mean is not None,
        )

    def specs(self) -> tuple[TensorSpec, ...]:
        """The sidecar's messages, in send order."""
        index, key, value = dtype_name(PAGE_INDEX_DTYPE), dtype_name(self.k_dtype), dtype_name(self.v_dtype)
        pages, d_h = self.num_pages, self.head_dim
        specs = [
            TensorSpec("page_offsets", (self.num_layers, self.num_owners + 1), index),
            TensorSpec("page_first", (pages,), index),
            TensorSpec("page_count", (pages,), index),
            TensorSpec("page_min", (pages, d_h), key),
            TensorSpec("page_max", (pages, d_h), key),
        ]
        if self.code_bits:
            codes = (self.coded_rows, self.code_width)
            specs.append(TensorSpec("row_codes", codes, dtype_name(CODE_DTYPE)))
        if self.value_means:
            specs.append(TensorSpec("page_value_mean", (pages, d_h), value))
        if self.host_rows is not None:
            rows = self.host_rows
            specs += [
                TensorSpec("omitted_k", (rows, d_h), key),
                TensorSpec("omitted_v", (rows, d_h), value),
                TensorSpec("omitted_positions", (rows,), index),
                TensorSpec("page_rows", (pages + 1,), index),
            ]
        return tuple(specs)

    @property
    def code_width(self) -> int:
        """Bytes of one row's codes (d_h codes of `code_bits` bits)."""
        return self.head_dim * self.code_bits // 8

    @property
    def page_summary_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs() if s.name in SUMMARY_FIELDS)

    @property
    def host_tier_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs() if s.name in HOST_TIER_FIELDS)

    @property
    def nbytes(self) -> int:
        return self.page_summary_bytes + self.host_tier_bytes


def split_specs(specs: list[TensorSpec]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(view specs, sidecar specs): the sidecar's messages are the trailing ones it names."""
    cut = len(specs)
    while cut > 0 and specs[cut - 1].name in SIDECAR_FIELDS:
        cut -= 1
    return specs[:cut], specs[cut:]


def sidecar_from_specs(specs: list[TensorSpec], page_size: int, v_dtype: torch.dtype) -> SidecarLayout | None:
    """The sidecar layout the trailing specs of a descriptor describe (None when there are
    none); they must be exactly those `SidecarLayout.specs()` lists."""
    if not specs:
        return None
    by_name = {spec.name: spec for spec in specs}
    if set(PAGE_FIELDS) - set(by_name):
        raise DescriptorInvalid("tensors", f"sidecar lacks {sorted(set(PAGE_FIELDS) - set(by_name))}")
    offsets, page_min = by_name["page_offsets"], by_name["page_min"]
    if len(offsets.shape) != 2 or len(page_min.shape) != 2:
        raise DescriptorInvalid("tensors.page_offsets", "page_offsets and page_min must be 2-D")
    host = by_name.get("omitted_k")
    local_v = by_name.get("omitted_v") or by_name.get("page_value_mean")
    layout = SidecarLayout(
        num_layers=offsets.shape[0],
        num_owners=offsets.shape[1] - 1,
        num_pages=page_min.shape[0],
        head_dim=page_min.shape[1],
        page_size=page_size,
        k_dtype=dtype_from_name(page_min.dtype, "tensors.page_min.dtype"),
        v_dtype=dtype_from_name(local_v.dtype, f"tensors.{local_v.name}.dtype") if local_v else v_dtype,
        host_rows=None if host is None else (host.shape[0] if len(host.shape) == 2 else -1),
        **_codes_of(by_name.get("row_codes"), page_min.shape[1]),
        value_means="page_value_mean" in by_name,
    )
    if tuple(specs) != layout.specs():
        raise DescriptorInvalid("tensors", f"sidecar specs {specs} != {list(layout.specs())}")
    return layout


def _codes_of(spec: TensorSpec | None, head_dim: int) -> dict[str, int]:
    """`code_bits` and `coded_rows` of a row_codes spec: its bits are its width * 8 / d_h."""
    if spec is None:
        return {}
    if spec.dtype != dtype_name(CODE_DTYPE):
        reason = f"{spec.dtype!r}, row codes are {dtype_name(CODE_DTYPE)}"
        raise DescriptorInvalid("tensors.row_codes.dtype", reason)
    widths = {head_dim * bits // 8: bits for bits in CODE_BITS if head_dim * bits % 8 == 0}
    if len(spec.shape) != 2 or spec.shape[1] not in widths:
        reason = f"{list(spec.shape)} is not [N, d_h * b / 8], d_h = {head_dim}, b in {CODE_BITS}"
        raise DescriptorInvalid("tensors.row_codes.shape", reason)
    return {"code_bits": widths[spec.shape[1]], "coded_rows": spec.shape[0]}


def check_sidecar(layout: SidecarLayout, sidecar: Sidecar, key: TransferKey) -> None:
    """TransferMismatch unless `sidecar` has exactly the layout's shapes and dtypes."""
    tensors = sidecar.tensors()
    specs = layout.specs()
    if list(tensors) != [spec.name for spec in specs]:
        raise TransferMismatch(key, "sidecar", f"carries {list(tensors)}, descriptor says {[s.name for s in specs]}")
    if sidecar.summaries.page_size != layout.page_size:
        raise TransferMismatch(key, "page_size", f"{sidecar.summaries.page_size} != {layout.page_size}")
    if sidecar.summaries.code_bits != layout.code_bits:
        bits = sidecar.summaries.code_bits
        raise TransferMismatch(key, "code_bits", f"{bits} != {layout.code_bits}")
    for spec in specs:
        tensor = tensors[spec.name]
        if tuple(tensor.shape) != spec.shape or dtype_name(tensor.dtype) != spec.dtype:
            got = f"{tuple(tensor.shape)} {dtype_name(tensor.dtype)}"
            raise TransferMismatch(key, spec.name, f"got {got}, descriptor says {spec.shape} {spec.dtype}")


def allocate_sidecar(layout: SidecarLayout, device: torch.device) -> dict[str, torch.Tensor]:
    """Receive buffers of every sidecar message, by name (on the pair group's device)."""
    return {
        spec.name: torch.empty(spec.shape, dtype=dtype_from_name(spec.dtype, spec.name), device=device)
        for spec in layout.specs()
    }


def sidecar_from_buffers(layout: SidecarLayout, buffers: dict[str, torch.Tensor], key: TransferKey) -> Sidecar:
    """The received sidecar, in host memory and validated (PageSummaries/OmittedRows check
    their own consistency); TransferMismatch naming the field otherwise."""
    host = {name: tensor.cpu() for name, tensor in buffers.items()}
    try:
        summaries = PageSummaries(
            page_size=layout.page_size,
            page_min=host["page_min"],
            page_max=host["page_max"],
            page_first=host["page_first"],
            page_count=host["page_count"],
            page_offsets=host["page_offsets"],
            code_bits=layout.code_bits,
            row_codes=host.get("row_codes"),
            page_value_mean=host.get("page_value_mean"),
        )
        rows = None
        if layout.host_rows is not None:
            rows = OmittedRows(
                k=host["omitted_k"],
                v=host["omitted_v"],
                positions=host["omitted_positions"],
                page_rows=host["page_rows"],
                page_offsets=host["page_offsets"],
            )
    except OffloadError as exc:
        raise TransferMismatch(key, f"sidecar.{exc.field}", exc.reason) from exc
    return Sidecar(summaries, rows)


def _count(field: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DescriptorInvalid(field, f"must be an int >= {minimum}, got {value!r}")


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())
