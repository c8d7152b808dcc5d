"""Workspace of a compression transaction: the bytes each stage of `services.kvpolicy.compress`
holds besides the source cache, as formulas of the manifest and the prompt length.

Notation (a prompt of T tokens under one manifest): L layers, H_q query heads, H_o owners per
layer (H_kv, or H_q under GQA `expand`), W = min(W_obs, T) observation rows (0 for static
policies, which capture none), T_p = T - W prefix rows, T_c = T_p - min(sinks, T_p) candidate
rows per owner, R retained rows. fp32 is 4 bytes, int64 8, bool 1.

    observation   4 L H_q T_p + 8 L        the runtime's vote of the window `[L, H_q, T_p]` fp32
                                           and per-layer extremes (its rows are not kept)
    scores        4 L H_o T_p              SnapKV owner scores `[L, H_owner, T_p]` fp32
    scoring       max of its steps, besides the observation (`score_workspace_bytes`)
    allocation    the allocator's tensors besides the scores (`allocator_workspace_bytes`)
    selection     the selector's tensors besides the scores (`selection_workspace_bytes`)
    compaction    the gather index and the view check, besides source and view
                  (`compaction_workspace_bytes`)

Each formula follows the tensors the code allocates (`services.kvpolicy.snapkv`,
`allocation`, `packing`), counted by torch's own allocator accounting in
tests/services/kvpolicy/test_kvpolicy_workspace.py; a change of those modules that changes
what they allocate changes these formulas in the same change. Not counted: Python objects
(position tuples, Fractions), the model's forward (it ends before the transaction starts),
and the offload stage's gather of omitted rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.kvpolicy.manifest import (
    AllocationMethod,
    GQAOrder,
    GQAReduction,
    KVVisibilityPolicyManifest,
    Pooling,
    ScoreAggregation,
    SelectionMethod,
    SnapKVParams,
)

_FP32 = 4
_FP64 = 8
_INT64 = 8
_INT32 = 4
_BOOL = 1
# The k-th largest of n fp32 keys (`snapkv.kth_largest`): the partition's scratch copy of the
# keys (4 n), then the 0-d value it returns (4).
_KTH_BYTES_PER_KEY = _FP32
_KTH_RESULT_BYTES = _FP32


@dataclass(frozen=True)
class Workspace:
    """The transaction's workspace terms, in bytes (all 0 for a static policy, except
    compaction)."""

    observation_bytes: int = 0
    score_bytes: int = 0
    score_workspace_bytes: int = 0
    allocator_workspace_bytes: int = 0
    selection_workspace_bytes: int = 0
    compaction_workspace_bytes: int = 0


@dataclass(frozen=True)
class _Shape:
    """The sizes every formula reads."""

    layers: int
    q_heads: int
    owners: int
    window: int
    prompt: int
    prefix: int
    candidates: int


def transaction_workspace(
    manifest: KVVisibilityPolicyManifest, prompt_len: int, counts: Sequence[int]
) -> Workspace:
    """Every workspace term of compressing a prompt of `prompt_len` tokens under `manifest`
    into a selection retaining `counts` positions per (layer, owner), layer-major."""
    expanded_span = prompt_len if manifest.expanded_owner_map is not None else 0
    compaction = compaction_workspace_bytes(
        manifest.tensor.num_layers, manifest.num_owners, sum(counts), expanded_span
    )
    params = manifest.selection.snapkv
    if manifest.selection.method is not SelectionMethod.SNAPKV or params is None:
        return Workspace(
            selection_workspace_bytes=_static_selection_bytes(counts),
            compaction_workspace_bytes=compaction,
        )
    shape = _shape(manifest, params, prompt_len)
    return Workspace(
        observation_bytes=observation_vote_bytes(shape.layers, shape.q_heads, shape.prefix),
        score_bytes=_score_bytes(shape),
        score_workspace_bytes=_score_workspace_bytes(
            params, shape, manifest.tensor.resolved_q_to_kv_head_map()
        ),
        allocator_workspace_bytes=_allocator_workspace_bytes(manifest, shape),
        selection_workspace_bytes=_selection_workspace_bytes(manifest, shape, counts),
        compaction_workspace_bytes=compaction,
    )


def _score_workspace_bytes(params: SnapKVParams, shape: _Shape, head_map: Sequence[int]) -> int:
    """The most bytes scoring holds at once besides its input, the runtime's vote
    (`snapkv.voted_scores`; V = 4 L H_q T_p is the vote's size):

    - `mean` divides the vote: a copy V, held until scoring ends;
    - pooling (kernel k > 1) of the (divided) vote: the pooled output V, and max's padded
      vote 4 L H_q (T_p + 2 floor(k/2)) (its input counts only when it is the divided copy);
    - GQA reduction (`mean`/`max`) of the pooled vote, held beside the reduction's own rows
      (`_group_reduction_peak`); `expand` allocates nothing new.

    Under `gqa_order: reduce_then_pool` the reduction runs on the (divided) vote, then
    pooling runs on the owner votes `[L, H_owner, T_p]`. The input check compares L minima
    and maxima (a few bytes)."""
    vote = _FP32 * shape.layers * shape.q_heads * shape.prefix
    divided = vote if params.aggregation is ScoreAggregation.MEAN else 0
    reduces = params.gqa_reduction is not GQAReduction.EXPAND
    groups = (
        _group_reduction_peak(head_map, _FP32 * shape.layers * shape.prefix, params.gqa_reduction)
        if reduces else 0
    )
    if params.gqa_order is GQAOrder.REDUCE_THEN_POOL:
        pooling = _pooling_peak(params, shape, shape.owners)
        if not reduces and not divided and pooling:  # pooling reads the input vote itself
            pooling -= vote
        return max(divided + groups, divided + pooling)
    if reduces and shape.layers > 1:
        # One layer at a time (`snapkv.vote_scores`): the owner scores (the reduction's
        # output, held from the first layer on) beside one layer's pooled votes and its
        # reduction, or its pooling's own buffers.
        layer = replace(shape, layers=1)
        pooling = _pooling_peak(params, layer, shape.q_heads)
        pooled = _FP32 * shape.q_heads * shape.prefix if pooling else 0
        made = pooling - pooled  # the layer's input is a view of the vote
        group = _group_reduction_peak(head_map, _FP32 * shape.prefix, params.gqa_reduction)
        return divided + _score_bytes(shape) + max(made, pooled + group)
    pooling = _pooling_peak(params, shape, shape.q_heads)
    if pooling and not divided:
        pooling -= vote  # the input vote is not workspace
    pooled = vote if pooling else 0  # the pooled vote, held while it is reduced
    return max(divided + pooling, divided + pooled + groups)


def observation_vote_bytes(layers: int, q_heads: int, prefix: int) -> int:
    """What the transaction holds of the observation window: the runtime's vote
    `[L, H_q, T_p]` fp32 and each layer's smallest and largest probability (`ObservationVote`;
    the window's rows themselves are not kept)."""
    return _FP32 * layers * q_heads * prefix + 2 * _FP32 * layers


def _pooling_peak(params: SnapKVParams, shape: _Shape, heads: int) -> int:
    """`snapkv.pool_scores` over `[L, heads, T_p]` fp32 (P bytes): 0 when it returns its input
    itself (no pooling, kernel 1, no prefix); else the input and its output, avg 2P (its
    window sums are added into the output and divided in place), and max's padded input
    beside them, 2P + pad."""
    kernel = params.pooling_kernel
    if params.pooling is Pooling.NONE or kernel == 1 or shape.prefix == 0:
        return 0
    pooled = _FP32 * shape.layers * heads * shape.prefix
    if params.pooling is Pooling.AVG:
        return 2 * pooled
    padded = _FP32 * shape.layers * heads * (shape.prefix + 2 * (kernel // 2))
    return 2 * pooled + padded


def _allocator_workspace_bytes(manifest: KVVisibilityPolicyManifest, shape: _Shape) -> int:
    """The allocator's tensors besides the scores (`allocation.allocate`). None when the
    prompt fits the capacity (every owner keeps all its candidates) and for uniform,
    PyramidKV and HeadKV (exact fractions, no tensors). Ada-KV, one layer at a time: its
    position-major copy of the layer's scores (4 n, n = H_o T_c; none when H_o = 1) and the
    k-th-value selection over it (4 n + 4, `snapkv.top_k_mask`). ZigZagKV
    (`allocation.layer_min_budget`), with M = L H_o T_c: while sorting, the fp64 copy of the
    candidate scores, its sorted values and indices (24 M) and
    the sort's buffer of one row (8 T_c); then sorted values, their cumulative sum, the
    coverage mask and the int64 copy that summing the mask makes (25 M), beside two int64
    `[L, H_o]` tensors (the mass targets and the counts) — whichever is larger."""
    spec = manifest.selection.allocation
    if spec is None or shape.prompt <= manifest.selection.capacity(shape.prompt):
        return 0
    if spec.method is AllocationMethod.ADAKV:
        keys = shape.owners * shape.candidates
        copy = _FP32 * keys if shape.owners > 1 else 0
        return copy + _KTH_BYTES_PER_KEY * keys + _KTH_RESULT_BYTES
    if spec.method is AllocationMethod.ZIGZAGKV:
        keys = shape.layers * shape.owners * shape.candidates
        sorting = (2 * _FP64 + _INT64) * keys + _INT64 * shape.candidates
        counting = (2 * _FP64 + _BOOL + _INT64) * keys + 2 * _INT64 * shape.layers * shape.owners
        return max(sorting, counting)
    return 0


def _selection_workspace_bytes(
    manifest: KVVisibilityPolicyManifest, shape: _Shape, counts: Sequence[int]
) -> int:
    """The selector's tensors besides the scores (`snapkv.select_snapkv`), whichever step
    holds most, with A = 8 (min(sinks, T_p) + W) for the protected positions (int64), E = 8 T
    when an owner keeps the whole prompt (one shared int64 range), and C_i = 8 b_i the
    chosen positions of the owners that select before owner i:

    - the NaN check's mask, L H_o T_p bool;
    - owner i's k-th-value selection over its T_c candidates (its scratch copy, 4 T_c + 4,
      `snapkv.top_k_mask`), or what follows it, its mask and the kept indices (T_c + 8 b_i;
      the larger when b_i > 3 T_c / 8), beside A + E + C_i;
    - the finished grid (`PositionGrid`: 8 R int64 positions, 8 L H_o counts) beside its
      parts, A + E + 8 sum(b_i).

    Only an owner that keeps some but not all of its candidates selects (b_i of them); the tie
    rule changes nothing."""
    nan_mask = _BOOL * shape.layers * shape.owners * shape.prefix
    protected = min(manifest.selection.protected.sinks, shape.prefix) + shape.window
    parts = _INT64 * protected + (_INT64 * shape.prompt if shape.prompt in counts else 0)
    peak, chosen = nan_mask, 0
    for count in counts:
        budget = count - protected
        if 0 < budget < shape.candidates:
            kth = _KTH_BYTES_PER_KEY * shape.candidates + _KTH_RESULT_BYTES
            kept = _BOOL * shape.candidates + _INT64 * budget  # its mask and kept indices
            peak = max(peak, parts + chosen + max(kth, kept))
            chosen += _INT64 * budget
    grid = _INT64 * (sum(counts) + len(counts))
    return max(peak, parts + chosen + grid)


def _static_selection_bytes(counts: Sequence[int]) -> int:
    """A static policy's selection (`static.static_selection`): one owner's positions as an
    int64 tensor (8 n, the same n for every owner), repeated into the grid beside it."""
    if not counts:
        return 0
    return _INT64 * (counts[0] + sum(counts) + len(counts))


def compaction_workspace_bytes(
    num_layers: int, num_owners: int, visible_rows: int, expanded_span: int = 0
) -> int:
    """What packing holds besides the source and the finished view, whichever step holds
    most: the view's construction check, its ascending mask over the position map (R bool)
    and the segment starts it exempts (two int64 tensors of at most L H_o entries); the
    receipt's comparison of the view's positions with the state's, on an int32 copy of the
    state's (4 R) beside an int64 copy of the view's offsets (8 L (H_o + 1)). Each segment is gathered by its positions straight into the view: no
    gather index (a source whose positions start past 0, never a prompt's, shifts them
    first: 8 R more). Under GQA `expand` the ledger counts each K/V head's distinct rows in
    a mask over the positions (`expanded_span` bools: the prompt)."""
    check = _BOOL * visible_rows + 2 * _INT64 * num_layers * num_owners
    receipt = _INT32 * visible_rows + _INT64 * num_layers * (num_owners + 1)
    return max(check, receipt, _BOOL * expanded_span)


def _shape(manifest: KVVisibilityPolicyManifest, params: SnapKVParams, prompt_len: int) -> _Shape:
    window = min(params.observation_window, prompt_len)
    prefix = prompt_len - window
    return _Shape(
        layers=manifest.tensor.num_layers,
        q_heads=manifest.tensor.num_q_heads,
        owners=manifest.num_owners,
        window=window,
        prompt=prompt_len,
        prefix=prefix,
        candidates=prefix - min(manifest.selection.protected.sinks, prefix),
    )


def _score_bytes(shape: _Shape) -> int:
    return _FP32 * shape.layers * shape.owners * shape.prefix


def _group_reduction_peak(
    head_map: Sequence[int], row_bytes: int, reduction: GQAReduction = GQAReduction.MEAN
) -> int:
    """Peak of `snapkv.reduce_gqa` over `row_bytes` = 4 L T_p rows. Contiguous equal groups
    (every checkpoint's layout) reduce a view: the H_kv reduced rows (`mean` divides them
    in place). Otherwise group i gathers its G_i query heads'
    rows (G_i rows) and reduces them (one row) while the i rows of the groups before it are
    held; then the stack writes H_kv rows beside those H_kv rows."""
    groups = [head_map.count(kv) for kv in range(max(head_map) + 1)]
    size = len(head_map) // len(groups)
    if list(head_map) == [q // size for q in range(len(head_map))]:
        return len(groups) * row_bytes
    peak = 0
    for done, size in enumerate(groups):
        peak = max(peak, (done + size + 1) * row_bytes)
    return max(peak, 2 * len(groups) * row_bytes)
