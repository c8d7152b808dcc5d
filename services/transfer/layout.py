"""What of a `PackedKVView` travels, and in which order.

A view moves layer by layer. Layer l is four messages, in this order:

    row_offsets[l]            [H + 1]    int32   global offsets of the layer's owner segments
    original_position_map[l]  [R_l]      int32
    packed_k[l]               [R_l, d_h] K dtype
    packed_v[l]               [R_l, d_h] V dtype

so the bytes moved are exactly the view's payload plus its metadata (position map and
offsets), the ledger's `traffic_bytes`. The descriptor lists these `4 L` tensor specs in
send order; `ViewLayout` is their parsed form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.kvpolicy.packing import OFFSET_DTYPE, POSITION_DTYPE, PackedKVView
from services.transfer.errors import DescriptorInvalid, TransferKey, TransferMismatch

WIRE_FIELDS = ("row_offsets", "original_position_map", "packed_k", "packed_v")
_WIRE_RANKS = (1, 1, 2, 2)
MAX_LAYERS = 4096  # keeps every message tag (4 l + field) far below gloo's 32-bit limit


@dataclass(frozen=True)
class TensorSpec:
    """One message of a transfer: name, shape and dtype (torch name without `torch.`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * dtype_from_name(self.dtype, "dtype").itemsize


@dataclass(frozen=True)
class ViewLayout:
    """Shape contract of a packed view on the wire: rows per layer, owners, head dim, dtypes.

    Known before packing (the allocation fixes every segment's length), so the descriptor
    can travel while later layers are still being packed.
    """

    layer_rows: tuple[int, ...]  # [L] rows R_l of each layer
    num_owners: int
    head_dim: int
    k_dtype: torch.dtype
    v_dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_rows", tuple(self.layer_rows))
        if not 1 <= len(self.layer_rows) <= MAX_LAYERS:
            raise DescriptorInvalid("layout.layer_rows", f"need 1..{MAX_LAYERS} layers, got {len(self.layer_rows)}")
        for layer, rows in enumerate(self.layer_rows):
            _non_negative_int(f"layout.layer_rows[{layer}]", rows)
        _positive_int("layout.num_owners", self.num_owners)
        _positive_int("layout.head_dim", self.head_dim)
        for name in ("k_dtype", "v_dtype"):
            if not isinstance(getattr(self, name), torch.dtype):
                raise DescriptorInvalid(f"layout.{name}", f"{getattr(self, name)!r} is not a torch dtype")

    @classmethod
    def of(cls, view: PackedKVView) -> ViewLayout:
        """The layout of an already packed view."""
        offsets = view.row_offsets.cpu()  # [L, H + 1]
        return cls(
            layer_rows=tuple(int(n) for n in (offsets[:, -1] - offsets[:, 0]).tolist()),
            num_owners=view.num_kv_heads,
            head_dim=view.head_dim,
            k_dtype=view.packed_k.dtype,
            v_dtype=view.packed_v.dtype,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_rows)

    @property
    def total_rows(self) -> int:
        return sum(self.layer_rows)

    def layer_start(self, layer: int) -> int:
        """Global packed row where `layer` begins."""
        return sum(self.layer_rows[:layer])

    def layer_specs(self, layer: int) -> tuple[TensorSpec, ...]:
        """The four messages of one layer, in send order."""
        rows, head_dim = self.layer_rows[layer], self.head_dim
        return (
            TensorSpec(f"row_offsets[{layer}]", (self.num_owners + 1,), dtype_name(OFFSET_DTYPE)),
            TensorSpec(f"original_position_map[{layer}]", (rows,), dtype_name(POSITION_DTYPE)),
            TensorSpec(f"packed_k[{layer}]", (rows, head_dim), dtype_name(self.k_dtype)),
            TensorSpec(f"packed_v[{layer}]", (rows, head_dim), dtype_name(self.v_dtype)),
        )

    def specs(self) -> tuple[TensorSpec, ...]:
        """Every message of the transfer, in send order."""
        return tuple(spec for layer in range(self.num_layers) for spec in self.layer_specs(layer))

    @property
    def nbytes(self) -> int:
        """Bytes the transfer moves: packed K/V plus position map and offsets."""
        return sum(spec.nbytes for spec in self.specs())


def layout_from_specs(specs: Sequence[TensorSpec]) -> ViewLayout:
    """Parse the ordered specs of a descriptor back into a layout; they must match exactly."""
    if not specs or len(specs) % len(WIRE_FIELDS):
        raise DescriptorInvalid("tensors", f"expected 4 specs per layer, got {len(specs)}")
    for index, spec in enumerate(specs):
        if len(spec.shape) != _WIRE_RANKS[index % len(WIRE_FIELDS)]:
            raise DescriptorInvalid(f"tensors[{index}].shape", f"{spec.shape} has the wrong rank for {spec.name!r}")
    num_layers = len(specs) // len(WIRE_FIELDS)
    offsets, _, first_k, first_v = specs[: len(WIRE_FIELDS)]
    layout = ViewLayout(
        layer_rows=tuple(specs[4 * layer + 2].shape[0] for layer in range(num_layers)),
        num_owners=offsets.shape[0] - 1,
        head_dim=first_k.shape[1],
        k_dtype=dtype_from_name(first_k.dtype, "tensors[2].dtype"),
        v_dtype=dtype_from_name(first_v.dtype, "tensors[3].dtype"),
    )
    for index, (got, want) in enumerate(zip(specs, layout.specs(), strict=True)):
        if got != want:
            raise DescriptorInvalid(f"tensors[{index}]", f"{got} != {want}, expected by the layout of the other specs")
    return layout


@dataclass(frozen=True)
class PackedLayer:
    """The part of a packed view that travels for one layer (tensors are views, no copies)."""

    layer: int
    row_offsets: torch.Tensor  # [H + 1] int32, global
    original_position_map: torch.Tensor  # [R_l] int32
    packed_k: torch.Tensor  # [R_l, d_h]
    packed_v: torch.Tensor  # [R_l, d_h]

    def wire_tensors(self) -> tuple[torch.Tensor, ...]:
        """The layer's tensors in send order (`WIRE_FIELDS`)."""
        return (self.row_offsets, self.original_position_map, self.packed_k, self.packed_v)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.wire_tensors())


def layer_of(view: PackedKVView, layer: int) -> PackedLayer:
    """Slice one layer out of a packed view."""
    offsets = view.row_offsets[layer]  # [H + 1]
    rows = slice(int(offsets[0]), int(offsets[-1]))
    return PackedLayer(
        layer=layer,
        row_offsets=offsets,
        original_position_map=view.original_position_map[rows],
        packed_k=view.packed_k[rows],
        packed_v=view.packed_v[rows],
    )


def check_layer(layout: ViewLayout, layer: PackedLayer, key: TransferKey) -> None:
    """Raise TransferMismatch unless `layer` has exactly the shapes, dtypes and offsets the
    layout promises (offsets start and end at the layer's global rows and never decrease)."""
    if not 0 <= layer.layer < layout.num_layers:
        raise TransferMismatch(key, "layer", f"{layer.layer} outside [0, {layout.num_layers})")
    for spec, tensor in zip(layout.layer_specs(layer.layer), layer.wire_tensors(), strict=True):
        if tuple(tensor.shape) != spec.shape or dtype_name(tensor.dtype) != spec.dtype:
            got = f"{tuple(tensor.shape)} {dtype_name(tensor.dtype)}"
            raise TransferMismatch(key, spec.name, f"got {got}, descriptor says {spec.shape} {spec.dtype}")
    offsets = [int(x) for x in layer.row_offsets.tolist()]
    start = layout.layer_start(layer.layer)
    end = start + layout.layer_rows[layer.layer]
    if offsets[0] != start or offsets[-1] != end or any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
        raise TransferMismatch(
            key, f"row_offsets[{layer.layer}]", f"{offsets} must rise monotonically from {start} to {end}"
        )


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the wire spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, field: str) -> torch.dtype:
    """The torch dtype of a wire name; DescriptorInvalid naming `field` if there is none."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise DescriptorInvalid(field, f"{name!r} is not a torch dtype")
    return dtype


def _positive_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DescriptorInvalid(field, f"must be a positive int, got {value!r}")


def _non_negative_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DescriptorInvalid(field, f"must be a non-negative int, got {value!r}")
