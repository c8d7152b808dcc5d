"""Token sampling (greedy, temperature, top-k, top-p) and stop decisions. Pure functions over
logits. The randomness of output token i of a seeded request is one uniform, a counter-based
function of (seed, i) alone (`seeded_uniform`), so the same tokens come out whichever worker
samples them (the first token is sampled by the prefill worker, the rest by the decode worker)
and whatever shares the batch.

`SamplingParams` is the one sampling type of a request, from the gateway to the decode worker;
`check_sampling` is its one rule set: every hop (gateway, prefill, decode) calls it with its own
`SamplingLimits`, and every `SamplingParams` runs its value rules when it is built. The proto's
conventions (top_p 0 and seed 0 mean unset) are mapped in `services.transfer.codec`, once.

Every value `check_sampling` admits samples a valid token from any sound logits row: the
arithmetic is float64 and the temperature divides logits shifted by their maximum, so the best
token's scaled logit is exactly 0 and no other can overflow — `(z - max z) / T` lies in
[-inf, 0] for every finite T > 0, subnormal (5e-324) or huge (1.8e308). As T -> 0 sampling
tends to greedy (uniform among tied maxima), as T -> inf to uniform over the top-k / top-p
support; no minimum temperature is needed. top-k and top-p rank the raw logits (a positive
temperature keeps their order, and ties made by float rounding never widen or reorder them);
top-p compares float64 mass against top_p, so the best token survives any top_p > 0. A row
that is not sound (a NaN, a +inf, or no finite entry: `finite_rows`) is a computation's
fault, never a parameter's: `sample` refuses it with `NonFiniteLogits` naming the rows, and
the decode loop fails that request alone."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.model.errors import InvalidModelInput, NonFiniteLogits

FINISH_EOS = "eos"
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 and top_p 1.0 disable those filters; seed None =
    unseeded. Construction checks the value rules of `check_sampling` (InvalidModelInput)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        check_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SamplingLimits:
    """What one hop admits: stop ids below `vocab_size` and at most `max_stop_token_ids` of
    them, 1 to `max_tokens` output tokens (the first one included)."""

    vocab_size: int
    max_tokens: int
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS


def check_sampling(
    params: SamplingParams, max_tokens: int | None = None, limits: SamplingLimits | None = None
) -> None:
    """The rule set of a request's sampling; InvalidModelInput names the field (`sampling.top_p`,
    `sampling.stop_token_ids[3]`, ...). Without `limits`, the value rules only: temperature
    finite and >= 0, top_k >= 0, top_p in (0, 1], stop ids >= 0. With them, also the hop's
    bounds: `max_tokens` in [1, limits.max_tokens], the count of stop ids and their range.
    Every value these rules admit samples safely: `sample` needs no rule of its own."""
    if not (math.isfinite(params.temperature) and params.temperature >= 0.0):
        reason = f"{params.temperature} must be finite and >= 0 (0 = greedy)"
        raise InvalidModelInput("sampling.temperature", reason)
    if params.top_k < 0:
        raise InvalidModelInput("sampling.top_k", f"{params.top_k} must be >= 0 (0 disables top-k)")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidModelInput("sampling.top_p", f"{params.top_p} is not in (0, 1] (1 disables top-p)")
    vocab_size = limits.vocab_size if limits is not None else None
    for index, token in enumerate(params.stop_token_ids):
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = vocab_size if vocab_size is not None else "vocab_size"
            reason = f"{token} is not a token id in [0, {bound})"
            raise InvalidModelInput(f"sampling.stop_token_ids[{index}]", reason)
    if limits is None:
        return
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidModelInput(
            "sampling.stop_token_ids",
            f"{len(params.stop_token_ids)} ids exceeds the limit of {limits.max_stop_token_ids}",
        )
    if max_tokens is None or not 1 <= max_tokens <= limits.max_tokens:
        raise InvalidModelInput("sampling.max_tokens", f"{max_tokens} is not in [1, {limits.max_tokens}]")


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Rows of logits `[B, V]` a token can be sampled from `[B]` bool: no NaN, no +inf, and at
    least one finite entry (-inf entries are tokens that cannot be drawn)."""
    finite = torch.isfinite(logits)
    if bool(finite.all()):  # the usual case: one pass
        return torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device)
    broken = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)
    return ~broken & finite.any(dim=-1)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
) -> torch.Tensor:
    """logits `[B, V]` -> token ids `[B]`; row b is output token steps[b] of a request
    sampled with params[b]. NonFiniteLogits names the rows that are not `finite_rows`.

    Vectorized over the batch: greedy rows take one argmax; sampled rows build one float64
    distribution `[S, V]` and draw by inverse CDF, one uniform per row: the first token whose
    cumulative mass exceeds u times the row's total. A seeded row's u is `seeded_uniform(seed,
    step)`, a counter-based value of (seed, step) alone (no generator is built or reseeded),
    so a row draws the same token whichever worker samples it and whatever shares the batch;
    unseeded rows take theirs in one draw from torch's global generator."""
    if len(params) != logits.shape[0] or len(steps) != logits.shape[0]:
        raise InvalidModelInput("sampling", "need one SamplingParams and step per logits row")
    unsound = (~finite_rows(logits)).nonzero().flatten().tolist()
    if unsound:
        raise NonFiniteLogits(tuple(unsound))
    tokens = logits.argmax(dim=-1)  # [B]; final for greedy rows
    drawn = [b for b, p in enumerate(params) if not p.greedy]
    if not drawn:
        return tokens
    index = torch.tensor(drawn, dtype=torch.long, device=logits.device)
    drawn_params = [params[b] for b in drawn]
    probs = batch_sampling_probs(logits.index_select(0, index), drawn_params)  # [S, V]
    uniforms = _uniforms(drawn_params, [steps[b] for b in drawn], probs.device)  # [S]
    tokens[index] = inverse_cdf(probs, uniforms)
    return tokens


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse CDF: for probs `[S, V]` (non-negative, positive total) and uniforms
    `[S]` in [0, 1), the first token whose cumulative mass exceeds u x total, `[S]` int64. A
    zero-mass token is never drawn (its cumulative mass equals its predecessor's); the clamp
    only guards against u x total rounding up to the total."""
    cdf = torch.cumsum(probs, dim=-1)  # [S, V]
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]  # [S, 1]
    drawn = torch.searchsorted(cdf, target, right=True)[:, 0]
    last = (probs > 0).cumsum(dim=-1).argmax(dim=-1)  # the last token with mass
    return torch.minimum(drawn, last)


def seeded_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) of output token `step` of a request seeded with `seed`: the top
    53 bits of splitmix64 of (seed, step), so neighbouring steps and seeds are unrelated."""
    return (_mix(seed, step) >> 10) * 2.0**-53


def _uniforms(
    params: Sequence[SamplingParams], steps: Sequence[int], device: torch.device
) -> torch.Tensor:
    """One uniform per sampled row `[S]` float64: a seeded row's from (seed, step), the
    unseeded rows' from one draw of torch's global generator."""
    values = torch.rand(len(params), dtype=torch.float64)
    seeded = [(i, seeded_uniform(p.seed, step))
              for i, (p, step) in enumerate(zip(params, steps, strict=True)) if p.seed is not None]
    if seeded:
        rows, draws = zip(*seeded, strict=True)
        values[list(rows)] = torch.tensor(draws, dtype=torch.float64)
    return values.to(device)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled (temperature > 0) request draws from, float64 `[V]`: zero
    outside the top-k and outside the smallest top-p nucleus, finite, and positive at the best
    token for every sound row (`finite_rows`) and every value `check_sampling` admits."""
    return batch_sampling_probs(logits[None], [params])[0]


def batch_sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`sampling_probs` of every row of logits `[S, V]` under its own params, float64 `[S, V]`;
    each row equals `sampling_probs` of that row alone (every step is row-wise)."""
    logits = logits.double()
    logits = _mask_top_k(logits, [p.top_k for p in params])
    temperature = torch.tensor(
        [p.temperature for p in params], dtype=torch.float64, device=logits.device
    )
    best = logits.amax(dim=-1, keepdim=True)
    scaled = (logits - best) / temperature[:, None]  # in [-inf, 0]; the best token is 0
    probs = torch.softmax(scaled, dim=-1)
    return _mask_top_p(probs, logits, [p.top_p for p in params])


def _mask_top_k(logits: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """-inf below each row's k-th largest logit (rows whose k is 0 or >= V untouched)."""
    vocab = int(logits.shape[-1])
    rows = [i for i, k in enumerate(top_k) if 0 < k < vocab]
    if not rows:
        return logits
    ks = torch.tensor([top_k[i] for i in rows], dtype=torch.long, device=logits.device)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    picked = logits.index_select(0, index)  # [R, V]
    largest = torch.topk(picked, int(ks.max()), dim=-1).values  # [R, k_max], descending
    kth = largest.gather(-1, (ks - 1)[:, None])  # [R, 1]
    out = logits.clone()
    out[index] = picked.masked_fill(picked < kth, float("-inf"))
    return out


def _mask_top_p(probs: torch.Tensor, logits: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """Zero outside each row's smallest top-p nucleus (rows whose top_p is 1 untouched). Tokens
    rank by logit, descending, equal logits by token id (a stable order: the same nucleus on
    every machine), which orders the probabilities too and keeps that order where a huge
    temperature rounds them to ties."""
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return probs
    index = torch.tensor(rows, dtype=torch.long, device=probs.device)
    threshold = torch.tensor([top_p[i] for i in rows], dtype=torch.float64, device=probs.device)
    picked = probs.index_select(0, index)  # [R, V]
    ranked = logits.index_select(0, index)
    keep = _nucleus(picked, ranked, threshold, min(NUCLEUS_CANDIDATES, int(ranked.shape[-1])))
    out = probs.clone()
    out[index] = picked.masked_fill(~keep, 0.0)
    return out


# Tokens ranked before a full sort is needed: a nucleus usually lies in the first few hundred.
NUCLEUS_CANDIDATES = 1024


def _nucleus(
    probs: torch.Tensor, logits: torch.Tensor, threshold: torch.Tensor, candidates: int
) -> torch.Tensor:
    """Which tokens of each row are in its nucleus `[R, V]` bool: ranked (stable order) until
    the mass before a token reaches the row's threshold. Ranks only the top `candidates`
    logits; a row whose nucleus may reach past the smallest of them (where top-k's order
    among equal logits is not the stable one) is ranked again by a full stable sort."""
    top = torch.topk(logits, candidates, dim=-1)  # every logit above the smallest is in it
    by_token, perm = top.indices.sort(dim=-1)  # then a stable sort by logit: ties by token
    values = top.values.gather(-1, perm)
    order = by_token.gather(-1, torch.sort(values, dim=-1, descending=True, stable=True).indices)
    keep_ranked, mass_before = _ranked_keep(probs, order, threshold)
    boundary = values.amin(dim=-1, keepdim=True)  # [R, 1]
    first_tie = (logits.gather(-1, order) == boundary).int().argmax(dim=-1, keepdim=True)
    exact = (mass_before.gather(-1, first_tie)[:, 0] >= threshold) | (
        candidates == int(logits.shape[-1])
    )
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_ranked)
    redo = (~exact).nonzero().flatten()
    if redo.numel():
        full = torch.sort(logits[redo], dim=-1, descending=True, stable=True).indices
        again, _ = _ranked_keep(probs[redo], full, threshold[redo])
        keep[redo] = torch.zeros_like(again).scatter_(-1, full, again)
    return keep


def _ranked_keep(
    probs: torch.Tensor, order: torch.Tensor, threshold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For tokens in rank `order [R, K]`: kept (the mass before them is below the threshold;
    exactly 0 for the best token, so it always is) and that mass before, both `[R, K]`."""
    ordered = probs.gather(-1, order)
    mass_before = torch.cumsum(ordered, dim=-1) - ordered
    return mass_before < threshold[:, None], mass_before


def _mix(seed: int, step: int) -> int:
    # splitmix64 of (seed, step): neighbouring steps and seeds get unrelated streams.
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def finish_reason(
    token: int,
    generated: int,
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
) -> str | None:
    """Why generation ends after `token` (the `generated`-th output token), or None to go on."""
    if not params.ignore_eos and token in eos_token_ids:
        return FINISH_EOS
    if token in params.stop_token_ids:
        return FINISH_STOP
    if generated >= max_new_tokens:
        return FINISH_LENGTH
    return None
