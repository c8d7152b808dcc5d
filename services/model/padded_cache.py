"""The padded decode cache this runtime used before paged KV (issue 17), kept as the baseline
`kvrelay bench paged-kv` measures the paged `DecodeCache` against: one padded slab per layer,
`[B_cap, H_owner, capacity, d_h]`, with a length per (request, owner). Capacity grows to 1.25x
the longest (request, owner) and never shrinks, and every step attends over the batch's longest
span, so memory and compute follow the batch's longest head, not the rows each request holds.
Same public interface as `services.model.kvcache.DecodeCache` (admit, append, step, undo).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.model.attention import (
    Attend,
    ragged_decode_attention,
    ragged_decode_attention_lse,
    varlen_decode_attention,
    varlen_decode_available,
)
from services.model.config import ModelConfig
from services.model.errors import InvalidModelInput
from services.model.kvcache import (
    PackedRows,
    SlottedCache,
    StepCapture,
    check_capacities,
    check_dense,
    check_view,
)

BACKENDS = ("auto", "padded", "varlen")


@dataclass
class LayerSlab:
    """One layer's padded rows for every batch slot (runtime state, mutated in place)."""

    keys: torch.Tensor  # [B_cap, H_kv, capacity, d_h]
    values: torch.Tensor  # [B_cap, H_kv, capacity, d_h]
    positions: torch.Tensor  # [B_cap, H_kv, capacity] int32, original position of each row
    lengths: torch.Tensor  # [B_cap, H_kv] int64, valid rows per (slot, head)

    @classmethod
    def zeros(cls, slots: int, heads: int, capacity: int, head_dim: int,
              dtype: torch.dtype, device: torch.device) -> LayerSlab:
        # Zero-filled so padding never holds NaN (0 * NaN would leak through the masked softmax).
        shape = (slots, heads, capacity, head_dim)
        return cls(
            keys=torch.zeros(shape, dtype=dtype, device=device),
            values=torch.zeros(shape, dtype=dtype, device=device),
            positions=torch.zeros(shape[:3], dtype=torch.int32, device=device),
            lengths=torch.zeros(shape[:2], dtype=torch.int64, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def resized(self, slots: int, capacity: int, used_slots: int, used_rows: int) -> LayerSlab:
        """A larger slab holding this one's first `used_slots` slots and `used_rows` rows."""
        grown = LayerSlab.zeros(slots, self.keys.shape[1], capacity, self.keys.shape[3],
                                self.keys.dtype, self.keys.device)
        grown.keys[:used_slots, :, :used_rows] = self.keys[:used_slots, :, :used_rows]
        grown.values[:used_slots, :, :used_rows] = self.values[:used_slots, :, :used_rows]
        grown.positions[:used_slots, :, :used_rows] = self.positions[:used_slots, :, :used_rows]
        grown.lengths[:used_slots] = self.lengths[:used_slots]
        return grown


class PaddedDecodeCache(SlottedCache):
    """Ragged per-(request, layer, owner head) KV rows for a batch of decoding requests.

    Requests occupy slots 0..B-1 in `request_ids` order; a decode step feeds one token per
    request in that order. Releasing a request moves the last slot into the hole.
    `owner_to_kv_head`: None = owners are the K/V heads; else one K/V head per owner.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        batch_capacity: int = 4,
        row_capacity: int = 256,
        backend: str = "auto",
        owner_to_kv_head: tuple[int, ...] | None = None,
    ) -> None:
        check_capacities(backend, BACKENDS, batch_capacity, row_capacity)
        super().__init__(config, dtype, device, owner_to_kv_head)
        self._slabs = [
            LayerSlab.zeros(batch_capacity, self.num_owners, row_capacity,
                            config.head_dim, dtype, self.device)
            for _ in range(config.num_layers)
        ]
        self._frontier = torch.zeros(batch_capacity, dtype=torch.int64, device=self.device)
        self._rows = np.zeros((config.num_layers, batch_capacity), dtype=np.int64)  # host max
        self._index_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._varlen = backend == "varlen" or (
            backend == "auto" and varlen_decode_available(self.device, dtype)
        )
        self._capture: StepCapture | None = None
        self._undoable = False  # the last call committed a step and nothing was written since

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every slab (keys, values, positions, lengths), padding included."""
        return sum(t.numel() * t.element_size() for slab in self._slabs
                   for t in (slab.keys, slab.values, slab.positions, slab.lengths))

    def lengths(self, request_id: str) -> torch.Tensor:
        """Rows held per (layer, owner) for one request `[L, H_owner]`."""
        slot = self._slot(request_id)
        return torch.stack([slab.lengths[slot] for slab in self._slabs])

    def rows(self, request_id: str, layer: int, head: int) -> tuple[torch.Tensor, ...]:
        """keys `[n, d_h]`, values `[n, d_h]`, original positions `[n]` held for one owner."""
        slot, slab = self._slot(request_id), self._slabs[layer]
        n = int(slab.lengths[slot, head])
        return slab.keys[slot, head, :n], slab.values[slot, head, :n], slab.positions[slot, head, :n]

    def admit_view(self, request_id: str, view: PackedRows, frontier: int) -> None:
        """Admit a request from a packed view; `frontier` is the next token's original position."""
        check_view(view, self.config, self.num_owners, frontier)
        slot = self._new_slot(request_id, frontier)
        for layer in range(self.config.num_layers):
            spans = [view.rows(layer, head) for head in range(self.num_owners)]
            self._reserve(layer, max(s.stop - s.start for s in spans) + 1)
            for head, span in enumerate(spans):
                self._write(layer, slot, head, view.packed_k[span], view.packed_v[span],
                            view.original_position_map[span])

    def admit_dense(
        self, request_id: str, keys: torch.Tensor, values: torch.Tensor,
        frontier: int | None = None,
    ) -> None:
        """Admit a request retaining every position: keys/values `[L, H_kv, T, d_h]`."""
        check_dense(self.config, keys, values)
        length = keys.shape[2]
        slot = self._new_slot(request_id, length if frontier is None else frontier)
        positions = torch.arange(length, dtype=torch.int32, device=self.device)
        kv_heads = (self._owner_map.tolist() if self._owner_map is not None
                    else range(self.config.num_kv_heads))
        for layer in range(self.config.num_layers):
            self._reserve(layer, length + 1)
            for owner, head in enumerate(kv_heads):
                self._write(layer, slot, owner, keys[layer, head], values[layer, head], positions)

    def append_rows(
        self, request_id: str, layer: int, head: int,
        keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
    ) -> None:
        """Add rows `[n, d_h]` at original `positions` `[n]` to one head (e.g. recalled rows)."""
        slot = self._slot(request_id)
        self._reserve(layer, int(self._slabs[layer].lengths[slot, head]) + keys.shape[0] + 1)
        self._write(layer, slot, head, keys, values, positions)

    def release(self, request_id: str) -> None:
        """Drop a request; the last slot moves into its place (only that request's rows copy).
        The dropped request's rows are zeroed: they stay behind as padding that other requests'
        attention reads with weight 0, and 0 * NaN would carry a fault of this request's KV
        into theirs (see `LayerSlab.zeros`)."""
        slot, last = self._slot(request_id), self.batch_size - 1
        self._undoable = False
        for layer, slab in enumerate(self._slabs):
            # + 1: the row a failed or undone step may have appended past the committed ones
            stop = min(int(self._rows[layer, slot]) + 1, slab.capacity)
            slab.keys[slot, :, :stop] = 0
            slab.values[slot, :, :stop] = 0
        if slot != last:
            for layer, slab in enumerate(self._slabs):
                used = min(int(self._rows[layer, last]) + 1, slab.capacity)
                slab.keys[slot, :, :used] = slab.keys[last, :, :used]
                slab.values[slot, :, :used] = slab.values[last, :, :used]
                slab.positions[slot, :, :used] = slab.positions[last, :, :used]
                slab.lengths[slot] = slab.lengths[last]
                slab.keys[last, :, :used] = 0
                slab.values[last, :, :used] = 0
            self._rows[:, slot] = self._rows[:, last]
            self._frontier[slot] = self._frontier[last]
            self.request_ids[slot] = self.request_ids[last]
        self.request_ids.pop()

    def begin_step(self, capture: StepCapture | None = None) -> torch.Tensor:
        """Make room for one more row per (request, layer, head); returns positions `[B]`.

        With `capture`, every layer of this step records its queries and log-sum-exps there
        (through the padded kernel, which also yields the log-sum-exp).
        """
        if not self.request_ids:
            raise InvalidModelInput("batch", "no request admitted")
        self._capture, self._undoable = capture, False
        for layer in range(self.config.num_layers):
            self._reserve(layer, int(self._rows[layer, : self.batch_size].max()) + 1)
        return self.frontier()

    def attention(self, layer: int) -> Attend:
        """The `Attend` of layer l for this step: append the new row to every owner, attend."""
        slab, window = self._slabs[layer], self.config.sliding_windows[layer]
        batch, scale, capture = self.batch_size, self.scale, self._capture

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q [B, H_q, d_h]; k, v [B, H_kv, d_h] at the frontier position
            if self._owner_map is not None:
                k, v = k[:, self._owner_map], v[:, self._owner_map]  # [B, H_owner, d_h]
            self._append_step(slab, k, v)
            if self._varlen and window is None and capture is None:
                return varlen_decode_attention(
                    q, slab.keys[:batch], slab.values[:batch], slab.lengths[:batch], scale
                )
            span = int(self._rows[layer, :batch].max()) + 1
            args = (q, slab.keys[:batch, :, :span], slab.values[:batch, :, :span],
                    slab.lengths[:batch], scale, self._outside_window(slab, span, window))
            if capture is None:
                return ragged_decode_attention(*args)
            out, lse = ragged_decode_attention_lse(*args)
            capture.record(layer, q, lse)
            return out

        return attend

    def end_step(self) -> None:
        """Commit the step: every owner gained one row, every frontier moves by one."""
        batch = self.batch_size
        self._rows[:, :batch] += 1
        self._frontier[:batch] += 1
        self._capture, self._undoable = None, True

    def undo_step(self) -> None:
        """Take back the step just committed: every request drops the row that step appended
        to each owner and its frontier moves back by one. Only right after `end_step`, before
        any row is written, a request admitted or released (else InvalidModelInput)."""
        if not self._undoable:
            raise InvalidModelInput("undo_step", "only the step just committed can be undone")
        batch = self.batch_size
        for slab in self._slabs:
            slab.lengths[:batch] -= 1
        self._rows[:, :batch] -= 1
        self._frontier[:batch] -= 1
        self._undoable = False

    def _append_step(self, slab: LayerSlab, k: torch.Tensor, v: torch.Tensor) -> None:
        slots, head_index = self._step_index(k.shape[0], k.shape[1])
        rows = slab.lengths[: k.shape[0]].reshape(-1)
        slab.keys[slots, head_index, rows] = k.reshape(-1, k.shape[-1]).to(slab.keys.dtype)
        slab.values[slots, head_index, rows] = v.reshape(-1, v.shape[-1]).to(slab.values.dtype)
        slab.positions[slots, head_index, rows] = self._frontier[slots].to(torch.int32)
        slab.lengths[: k.shape[0]] += 1

    def _step_index(self, batch: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        # (slot, owner) of every appended row `[B * H_owner]`, cached per batch size.
        if self._index_cache is None or self._index_cache[0].shape[0] != batch * heads:
            slots = torch.arange(batch, device=self.device).repeat_interleave(heads)
            self._index_cache = (slots, torch.arange(heads, device=self.device).repeat(batch))
        return self._index_cache

    def _outside_window(
        self, slab: LayerSlab, span: int, window: int | None
    ) -> torch.Tensor | None:
        if window is None:
            return None
        oldest = self.frontier() - window  # rows at or before this position are out of window
        return slab.positions[: self.batch_size, :, :span] <= oldest[:, None, None].to(torch.int32)

    def _new_slot(self, request_id: str, frontier: int) -> int:
        if request_id in self.request_ids:
            raise InvalidModelInput("request_id", f"{request_id!r} is already admitted")
        slot = self.batch_size
        self._undoable = False
        if slot == self._frontier.shape[0]:
            self._grow_batch(2 * slot)
        self.request_ids.append(request_id)
        self._frontier[slot] = frontier
        self._rows[:, slot] = 0
        for slab in self._slabs:
            slab.lengths[slot] = 0
        return slot

    def _grow_batch(self, slots: int) -> None:
        used = self.batch_size
        self._slabs = [
            slab.resized(slots, slab.capacity, used, int(self._rows[layer, :used].max(initial=0)))
            for layer, slab in enumerate(self._slabs)
        ]
        frontier = torch.zeros(slots, dtype=torch.int64, device=self.device)
        frontier[:used] = self._frontier[:used]
        self._frontier = frontier
        rows = np.zeros((self.config.num_layers, slots), dtype=np.int64)
        rows[:, :used] = self._rows[:, :used]
        self._rows = rows

    def _reserve(self, layer: int, needed_rows: int) -> None:
        slab = self._slabs[layer]
        if needed_rows <= slab.capacity:
            return
        capacity = max(needed_rows + needed_rows // 4, 2 * slab.capacity)  # headroom to append
        used = int(self._rows[layer, : self.batch_size].max(initial=0))
        self._slabs[layer] = slab.resized(slab.keys.shape[0], capacity, self.batch_size, used)

    def _write(
        self, layer: int, slot: int, head: int,
        keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
    ) -> None:
        slab = self._slabs[layer]
        self._undoable = False
        start = int(slab.lengths[slot, head])
        stop = start + keys.shape[0]
        slab.keys[slot, head, start:stop] = keys.to(device=self.device, dtype=self.dtype)
        slab.values[slot, head, start:stop] = values.to(device=self.device, dtype=self.dtype)
        slab.positions[slot, head, start:stop] = positions.to(device=self.device, dtype=torch.int32)
        slab.lengths[slot, head] = stop
        self._rows[layer, slot] = max(int(self._rows[layer, slot]), stop)
