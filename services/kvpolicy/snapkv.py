"""SnapKV: score prefix rows by the attention of the last W_obs prompt queries, keep the top-k.

Scoring, per layer (paper order, Li et al. 2024):
  1. observation attention `[H_q, W, T]`: window query i sits at position T - W + i and
     attends causally to every prompt key; softmax over visible keys in fp32;
  2. vote: sum (or mean) over the W window queries of the prefix columns `[0, T - W)`;
  3. stride-1 pooling over positions, avg or max with an odd kernel; avg counts the zero
     padding (AvgPool1d `count_include_pad=True`), max ignores it;
  4. GQA owner reduction: `mean` or `max` over the query heads of each K/V head (owners
     are K/V heads), or `expand` (owners are the query heads themselves).
Steps 3 and 4 run in the manifest's `gqa_order`: `pool_then_reduce` as listed (kvrelay's
default), or `reduce_then_pool` — reduce each K/V group's votes, then pool the owner votes (the
order of Ada-KV's and kvpress's GQA code). Both are linear for mean + avg and both maxima for
max + max, so the orders agree there; they differ for mean + max pooling and max + avg pooling.

Selection per owner: the observation suffix `[T - W, T)` and the first `sinks` positions
are protected and retained outside the budget; the top-`budget` remaining prefix rows
are kept, exactly those a stable descending sort puts first (ties by original position,
ascending unless the manifest's tie rule says descending), found by one k-th-value selection
per owner rather than a sort (`top_k_mask`). An owner whose budget covers all its candidates
keeps the whole prompt without selection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from services.kvpolicy.errors import SelectionError
from services.kvpolicy.manifest import (
    GQAOrder,
    GQAReduction,
    KVVisibilityPolicyManifest,
    Pooling,
    ScoreAggregation,
    SelectionMethod,
    SnapKVParams,
    TieRule,
)
from services.kvpolicy.state import PositionGrid


def observation_attention(
    q_window: torch.Tensor,
    keys: torch.Tensor,
    q_to_kv_head_map: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Reference observation attention of one layer, in fp32.

    q_window `[H_q, W, d_h]` are the last W prompt queries, keys `[H_kv, T, d_h]` all prompt
    keys (post-RoPE). Returns softmax probabilities `[H_q, W, T]`, zero above the causal
    diagonal (window query i sees keys `<= T - W + i`).
    """
    num_q_heads, window, head_dim = (int(x) for x in q_window.shape)
    seq_len = int(keys.shape[1])
    _check_head_map(q_to_kv_head_map, num_q_heads, int(keys.shape[0]))
    if window > seq_len:
        raise SelectionError("q_window", f"window {window} longer than the prompt {seq_len}")
    expanded = keys[list(q_to_kv_head_map)].float()  # [H_q, T, d_h]
    logits = q_window.float() @ expanded.transpose(1, 2)  # [H_q, W, T]
    logits = logits * (scale if scale is not None else 1.0 / math.sqrt(head_dim))
    query_pos = torch.arange(seq_len - window, seq_len).view(window, 1)
    visible = torch.arange(seq_len).view(1, seq_len) <= query_pos  # [W, T]
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)


def pool_scores(vote: torch.Tensor, pooling: Pooling, kernel: int) -> torch.Tensor:
    """Stride-1 pooling along the last axis, same length out. `[..., T_p] -> [..., T_p]`"""
    if kernel < 1 or kernel % 2 == 0:
        raise SelectionError(
            "selection.snapkv.pooling_kernel", f"must be a positive odd number, got {kernel}"
        )
    if pooling is Pooling.NONE or kernel == 1 or vote.shape[-1] == 0:
        return vote
    pad = kernel // 2
    if pooling is Pooling.AVG:
        return window_sums(vote, pad).div_(kernel)
    windows = F.pad(vote, (pad, pad), value=float("-inf")).unfold(-1, kernel, 1)  # [..., T_p, k]
    return windows.amax(dim=-1)


def window_sums(vote: torch.Tensor, pad: int) -> torch.Tensor:
    """`out[..., t] = vote[..., t - pad] + ... + vote[..., t + pad]` (zero outside the row),
    added left to right: one shifted in-place add per offset into one output, instead of a
    padded copy and a strided window reduction (whose summation order torch picks by the
    tensor's size). `[..., T] -> [..., T]`"""
    length = int(vote.shape[-1])
    total = torch.zeros_like(vote)
    for offset in range(-pad, pad + 1):
        span = length - abs(offset)
        if span <= 0:
            continue
        if offset < 0:  # out[t] += vote[t + offset] for t >= -offset
            total[..., -offset:] += vote[..., :span]
        else:
            total[..., :span] += vote[..., offset:]
    return total


def reduce_gqa(
    scores: torch.Tensor, q_to_kv_head_map: Sequence[int], reduction: GQAReduction
) -> torch.Tensor:
    """Per-query-head scores `[L, H_q, T_p]` to per-owner scores `[L, H_owner, T_p]`."""
    if reduction is GQAReduction.EXPAND:
        return scores
    num_kv_heads = max(q_to_kv_head_map) + 1
    group = len(q_to_kv_head_map) // num_kv_heads
    if list(q_to_kv_head_map) == [q // group for q in range(len(q_to_kv_head_map))]:
        # Contiguous equal groups (every checkpoint's layout): a view, no gathered copy; the
        # same sums, bit for bit, as the gathered groups below.
        grouped = scores.view(*scores.shape[:1], num_kv_heads, group, *scores.shape[2:])
        if reduction is GQAReduction.MEAN:
            return grouped.sum(dim=2).div_(group)
        return grouped.amax(dim=2)
    groups = [[q for q, kv in enumerate(q_to_kv_head_map) if kv == h] for h in range(num_kv_heads)]
    if reduction is GQAReduction.MEAN:
        return torch.stack([scores[:, g].sum(dim=1) / len(g) for g in groups], dim=1)
    return torch.stack([scores[:, g].amax(dim=1) for g in groups], dim=1)


def snapkv_scores(
    obs_attn: torch.Tensor | Sequence[torch.Tensor],
    prompt_len: int,
    window: int,
    pooling: Pooling,
    kernel: int,
    aggregation: ScoreAggregation,
    gqa_reduction: GQAReduction,
    q_to_kv_head_map: Sequence[int],
    gqa_order: GQAOrder = GQAOrder.POOL_THEN_REDUCE,
) -> torch.Tensor:
    """Owner scores of every prefix row: `[L, H_owner, T_prompt - W]` (fp32).

    obs_attn is `[L, H_q, W, T]` (or one `[H_q, W, T]` per layer): the softmax
    probabilities the model runtime returns for the observation window. `gqa_order` says
    whether pooling runs per query head before the GQA reduction or per owner after it.
    """
    attn = _stack_layers(obs_attn)  # [L, H_q, W, T]
    _check_obs_attn(attn, prompt_len, window, q_to_kv_head_map)
    vote = window_vote(attn, prompt_len - window)  # [L, H_q, T_p]
    _check_votes(attn, vote, prompt_len, window)
    return vote_scores(
        vote, window, pooling, kernel, aggregation, gqa_reduction, q_to_kv_head_map, gqa_order
    )


def window_vote(attn: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """The sum over the window queries of their probabilities on the prefix keys: observation
    `[..., W, T]` -> `[..., T_p]`. The one definition of the vote: the model runtime reduces
    each layer with it as soon as the layer's probabilities exist (`ObservationVote`), and
    summing one layer or all layers at once gives the same bits."""
    return attn[..., :prefix_len].sum(dim=-2)


class WindowVote(Protocol):
    """What the model runtime hands over instead of the observation (`ObservationVote` in
    `services.model.runtime`): the vote `[L, H_q, T - W]` fp32 of the W window queries, and
    the smallest and largest probability of each layer's observation `[L]` fp32."""

    @property
    def window(self) -> int: ...

    @property
    def vote(self) -> torch.Tensor: ...

    @property
    def minimum(self) -> torch.Tensor: ...

    @property
    def maximum(self) -> torch.Tensor: ...


def voted_scores(
    voted: WindowVote,
    prompt_len: int,
    pooling: Pooling,
    kernel: int,
    aggregation: ScoreAggregation,
    gqa_reduction: GQAReduction,
    q_to_kv_head_map: Sequence[int],
    gqa_order: GQAOrder = GQAOrder.POOL_THEN_REDUCE,
    window: int | None = None,
) -> torch.Tensor:
    """`snapkv_scores` from the runtime's vote: the same scores, bit for bit, without reading
    the observation again (400 MB at 16K tokens x 24 layers x 16 query heads, W 16). The
    input check is the one `snapkv_scores` makes, on the per-layer extremes: a NaN or
    negative probability is a negative or NaN minimum, an infinite one an infinite maximum;
    a vote that overflows from finite probabilities passes, as there."""
    vote = voted.vote
    expected_window = voted.window if window is None else window
    if voted.window != expected_window or expected_window < 1:
        raise SelectionError(
            "observation_vote.window",
            f"{voted.window}, the manifest scores with {expected_window}",
        )
    layers = int(vote.shape[0]) if vote.dim() == 3 else -1
    expected = (len(q_to_kv_head_map), prompt_len - voted.window)
    if vote.dim() != 3 or tuple(int(x) for x in vote.shape[1:]) != expected:
        raise SelectionError(
            "observation_vote.vote",
            f"expected [L, {expected[0]}, {expected[1]}], got {tuple(vote.shape)}",
        )
    _check_head_map(q_to_kv_head_map, len(q_to_kv_head_map), None)
    if tuple(voted.minimum.shape) != (layers,) or tuple(voted.maximum.shape) != (layers,):
        raise SelectionError("observation_vote.minimum", f"expected [{layers}] per-layer extremes")
    sound = (voted.minimum >= 0) & torch.isfinite(voted.maximum)  # NaN fails both comparisons
    if not bool(sound.all()):
        layer = int((~sound).nonzero()[0])
        raise SelectionError(
            "obs_attn", f"layer {layer}: probabilities must be finite and non-negative"
        )
    return vote_scores(
        vote, voted.window, pooling, kernel, aggregation, gqa_reduction, q_to_kv_head_map,
        gqa_order,
    )


def vote_scores(
    vote: torch.Tensor,
    window: int,
    pooling: Pooling,
    kernel: int,
    aggregation: ScoreAggregation,
    gqa_reduction: GQAReduction,
    q_to_kv_head_map: Sequence[int],
    gqa_order: GQAOrder = GQAOrder.POOL_THEN_REDUCE,
) -> torch.Tensor:
    """Owner scores `[L, H_owner, T_p]` from the window vote `[L, H_q, T_p]`: the aggregation
    (`mean` divides by W), pooling and the GQA reduction in the manifest's order."""
    if aggregation is ScoreAggregation.MEAN:
        vote = vote / window
    if gqa_order is GQAOrder.REDUCE_THEN_POOL:
        owner_vote = reduce_gqa(vote, q_to_kv_head_map, gqa_reduction)  # [L, H_owner, T_p]
        return pool_scores(owner_vote, pooling, kernel)
    if gqa_reduction is GQAReduction.EXPAND or vote.shape[0] <= 1:
        return reduce_gqa(pool_scores(vote, pooling, kernel), q_to_kv_head_map, gqa_reduction)
    # One layer at a time: a layer's pooled votes (a megabyte at 16K tokens and 16 query
    # heads) are reduced while they are still in cache, and the pooled votes of every layer
    # are never held at once. The same operations on each layer: the same bits.
    first = reduce_gqa(pool_scores(vote[:1], pooling, kernel), q_to_kv_head_map, gqa_reduction)
    scores = torch.empty((int(vote.shape[0]), *first.shape[1:]), dtype=first.dtype)
    scores[0] = first[0]
    del first
    for layer in range(1, int(vote.shape[0])):
        pooled = pool_scores(vote[layer : layer + 1], pooling, kernel)
        scores[layer] = reduce_gqa(pooled, q_to_kv_head_map, gqa_reduction)[0]
        del pooled
    return scores


def top_k_positions(
    scores: torch.Tensor, k: int, tie_rule: TieRule = TieRule.POSITION_ASCENDING
) -> list[int]:
    """Indices of the k largest entries of `scores [N]`, ascending; equal scores by the tie rule."""
    n = int(scores.shape[0])
    if k >= n:
        return list(range(n))
    if k <= 0:
        return []
    return top_k_mask(scores, k, tie_rule).nonzero().flatten().tolist()


def top_k_mask(
    scores: torch.Tensor, k: int, tie_rule: TieRule = TieRule.POSITION_ASCENDING
) -> torch.Tensor:
    """Which entries of `scores [N]` are among its k largest, `[N]` bool, for 0 < k < N: exactly
    the first k of a stable descending sort (equal scores: the earlier position first under
    `position_ascending`, the later under `position_descending`). One k-th-value selection
    instead of a sort: every score above the k-th largest is kept and, of those equal to it,
    the first (or last) ones still needed."""
    threshold = kth_largest(scores, k)
    kept = scores >= threshold
    extra = int(kept.count_nonzero()) - k  # count_nonzero: no int64 copy, unlike sum
    if extra == 0:  # one row at the threshold, or as many ties as the budget still takes
        return kept
    above = scores > threshold
    tied = kept.logical_xor_(above).nonzero().flatten()  # the ties' indices, ascending
    needed = k - int(above.count_nonzero())
    del kept
    # position_ascending keeps the first `needed` ties, position_descending the last ones
    chosen = tied[:needed] if tie_rule is TieRule.POSITION_ASCENDING else tied[extra:]
    return above.index_fill_(0, chosen, True)


def kth_largest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest entry of `scores [N]` (no NaN), 0 < k <= N, as a 0-d tensor: what
    `torch.kthvalue(scores, N - k + 1)` gives. On the CPU, numpy's introselect partitions a
    copy in place: it moves values only, where `kthvalue` carries an int64 index with every
    swap (about 6x slower over a 16K-row owner)."""
    n = int(scores.shape[0])
    if scores.device.type != "cpu" or scores.dtype not in (torch.float32, torch.float64):
        return torch.kthvalue(scores, n - k + 1).values
    work = scores.clone()  # the partition's scratch, on torch's allocator
    values = work.numpy()
    values.partition(n - k)
    return work[n - k].clone()


def select_snapkv(
    scores: torch.Tensor,
    budgets: Sequence[Sequence[int]],
    window: int,
    prompt_len: int,
    tie_rule: TieRule = TieRule.POSITION_ASCENDING,
    sinks: int = 0,
) -> PositionGrid:
    """Retained positions `[L][H_owner]`: protected sinks and suffix plus the top-budget rows.

    scores `[L, H_owner, T_p]` with T_p = prompt_len - min(window, prompt_len); budgets count
    selected prefix rows only (protected rows are outside the budget).
    """
    if window < 1:
        raise SelectionError(
            "selection.snapkv.observation_window", f"must be positive, got {window}"
        )
    prefix_len = prompt_len - min(window, prompt_len)
    _check_scores(scores, budgets, prefix_len)
    first = min(sinks, prefix_len)
    protected_head = torch.arange(first)
    suffix = torch.arange(prefix_len, prompt_len)
    candidates = prefix_len - first
    everything = torch.arange(prompt_len) if _any_keeps_all(budgets, candidates) else None
    segments: list[torch.Tensor] = []
    for layer in range(int(scores.shape[0])):
        for owner, budget in enumerate(budgets[layer]):
            if everything is not None and budget >= candidates:  # the whole prompt
                segments.append(everything)
                continue
            chosen = _chosen_positions(scores[layer, owner, first:], budget, first, tie_rule)
            segments += (protected_head, chosen, suffix)
    counts = [prompt_len if b >= candidates else first + b + prompt_len - prefix_len
              for layer_budgets in budgets for b in layer_budgets]
    shape = (int(scores.shape[0]), int(scores.shape[1]))
    return PositionGrid(torch.cat(segments), torch.tensor(counts, dtype=torch.long).view(shape))


def _any_keeps_all(budgets: Sequence[Sequence[int]], candidates: int) -> bool:
    return any(budget >= candidates for layer in budgets for budget in layer)


def _chosen_positions(
    candidates: torch.Tensor, budget: int, first: int, tie_rule: TieRule
) -> torch.Tensor:
    """The top-`budget` of one owner's candidates `[T_c]` (0 <= budget < T_c) as prompt
    positions (candidate i is position first + i), ascending, `[budget]` int64. Its own
    function so that one owner's temporaries are freed before the next owner's selection."""
    if budget == 0:
        return torch.zeros(0, dtype=torch.long)
    return top_k_mask(candidates, budget, tie_rule).nonzero().flatten().add_(first)


def score(
    manifest: KVVisibilityPolicyManifest,
    obs_attn: torch.Tensor | Sequence[torch.Tensor] | WindowVote,
    prompt_len: int,
) -> torch.Tensor:
    """`snapkv_scores` (or `voted_scores`, given the runtime's vote) with the manifest's
    parameters. `[L, H_owner, T_p]`

    For a prompt shorter than W_obs the window is the whole prompt and there is no prefix.
    """
    params = _snapkv_params(manifest)
    if not isinstance(obs_attn, torch.Tensor | Sequence):  # the runtime's vote
        return voted_scores(
            obs_attn,
            prompt_len,
            params.pooling,
            params.pooling_kernel,
            params.aggregation,
            params.gqa_reduction,
            manifest.tensor.resolved_q_to_kv_head_map(),
            params.gqa_order,
            window=min(params.observation_window, prompt_len),
        )
    return snapkv_scores(
        obs_attn,
        prompt_len,
        min(params.observation_window, prompt_len),
        params.pooling,
        params.pooling_kernel,
        params.aggregation,
        params.gqa_reduction,
        manifest.tensor.resolved_q_to_kv_head_map(),
        params.gqa_order,
    )


def select(
    manifest: KVVisibilityPolicyManifest,
    scores: torch.Tensor,
    budgets: Sequence[Sequence[int]],
    prompt_len: int,
) -> PositionGrid:
    """`select_snapkv` with the manifest's window, sinks and tie rule."""
    params = _snapkv_params(manifest)
    selection = manifest.selection
    return select_snapkv(
        scores,
        budgets,
        params.observation_window,
        prompt_len,
        selection.tie_rule,
        selection.protected.sinks,
    )


def protected_positions(manifest: KVVisibilityPolicyManifest, prompt_len: int) -> tuple[int, ...]:
    """Sinks and observation suffix of a prompt: retained by every owner."""
    params = _snapkv_params(manifest)
    prefix_len = prompt_len - min(params.observation_window, prompt_len)
    sinks = min(manifest.selection.protected.sinks, prefix_len)
    return tuple(range(sinks)) + tuple(range(prefix_len, prompt_len))


def _snapkv_params(manifest: KVVisibilityPolicyManifest) -> SnapKVParams:
    params = manifest.selection.snapkv
    if manifest.selection.method is not SelectionMethod.SNAPKV or params is None:
        raise SelectionError("selection.method", f"{manifest.selection.method.value} is not snapkv")
    return params


def _stack_layers(obs_attn: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    if isinstance(obs_attn, torch.Tensor):
        return obs_attn
    if not obs_attn:
        raise SelectionError("obs_attn", "no layers")
    shapes = {tuple(a.shape) for a in obs_attn}
    if len(shapes) != 1:
        raise SelectionError("obs_attn", f"layers disagree on shape: {sorted(shapes)}")
    return torch.stack(list(obs_attn))


def _check_head_map(head_map: Sequence[int], num_q_heads: int, num_kv_heads: int | None) -> None:
    if len(head_map) != num_q_heads:
        raise SelectionError(
            "q_to_kv_head_map", f"{len(head_map)} entries for {num_q_heads} query heads"
        )
    if any(h < 0 for h in head_map) or (
        num_kv_heads is not None and any(h >= num_kv_heads for h in head_map)
    ):
        raise SelectionError(
            "q_to_kv_head_map", f"{list(head_map)} names a K/V head outside [0, {num_kv_heads})"
        )
    if set(head_map) != set(range(max(head_map) + 1)):
        raise SelectionError(
            "q_to_kv_head_map", f"{list(head_map)} leaves a K/V head without query heads"
        )


def _check_obs_attn(
    attn: torch.Tensor, prompt_len: int, window: int, head_map: Sequence[int]
) -> None:
    if attn.dim() != 4:
        raise SelectionError("obs_attn", f"expected [L, H_q, W, T], got shape {tuple(attn.shape)}")
    if window < 1 or window > prompt_len:
        raise SelectionError(
            "selection.snapkv.observation_window",
            f"window {window} must be in [1, prompt_len = {prompt_len}]",
        )
    _, num_q_heads, attn_window, seq_len = (int(x) for x in attn.shape)
    if (attn_window, seq_len) != (window, prompt_len):
        raise SelectionError(
            "obs_attn", f"window x keys {attn_window} x {seq_len}, expected {window} x {prompt_len}"
        )
    _check_head_map(head_map, num_q_heads, None)
    # One reduction pass over the observation: its minimum is NaN or negative exactly when a
    # probability is; +inf (the one fault a minimum misses) shows in the votes (`_check_votes`).
    if not bool((attn.amin(dim=(1, 2, 3)) >= 0).all()):  # [L] minima, no copy of attn
        _check_obs_attn_exactly(attn)  # raises, naming the layer


def _check_votes(attn: torch.Tensor, vote: torch.Tensor, prompt_len: int, window: int) -> None:
    """+inf in the observation: every prefix column is in `vote` (a sum of non-negative
    terms, finite unless a term is +inf or the sum overflows) and the suffix is W x W wide."""
    finite = math.isfinite(float(vote.amax())) if vote.numel() else True
    if not (finite and math.isfinite(float(attn[..., prompt_len - window :].amax()))):
        _check_obs_attn_exactly(attn)  # raises unless only a finite sum overflowed


def _check_obs_attn_exactly(attn: torch.Tensor) -> None:
    # One layer at a time: the check's masks take 7 bytes per element, 1.75x the observation
    # itself if taken over all layers at once (the largest term of the transaction peak).
    for layer, rows in enumerate(attn):  # [H_q, W, T]
        if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()):
            raise SelectionError(
                "obs_attn", f"layer {layer}: probabilities must be finite and non-negative"
            )


def _check_scores(scores: torch.Tensor, budgets: Sequence[Sequence[int]], prefix_len: int) -> None:
    if scores.dim() != 3 or int(scores.shape[2]) != prefix_len:
        raise SelectionError(
            "scores", f"expected [L, H_owner, {prefix_len}], got shape {tuple(scores.shape)}"
        )
    if bool(torch.isnan(scores).any()):
        raise SelectionError("scores", "NaN score")
    num_layers, num_owners = int(scores.shape[0]), int(scores.shape[1])
    if len(budgets) != num_layers or any(len(b) != num_owners for b in budgets):
        raise SelectionError("budgets", f"expected [{num_layers}][{num_owners}] budgets")
    if any(
        isinstance(b, bool) or not isinstance(b, int) or b < 0 for layer in budgets for b in layer
    ):
        raise SelectionError("budgets", "budgets must be non-negative ints")
