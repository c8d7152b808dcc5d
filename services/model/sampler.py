"""Token sampling (greedy, temperature, top-k, top-p) and stop decisions. Pure functions over
logits. The randomness of output token i of a seeded request comes from a generator seeded with
(seed, i) alone, so the same tokens come out whichever worker samples them (the first token is
sampled by the prefill worker, the rest by the decode worker) and whatever shares the batch.

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
    broken = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)
    return ~broken & torch.isfinite(logits).any(dim=-1)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
) -> torch.Tensor:
    """logits `[B, V]` -> token ids `[B]`; row b is output token steps[b] of a request
    sampled with params[b]. NonFiniteLogits names the rows that are not `finite_rows`.

    Vectorized over the batch: greedy rows take one argmax, sampled rows one float64
    distribution `[S, V]` and one race `argmax(probs / Exp(1) noise)`, which is exactly what
    `torch.multinomial(probs, 1, generator)` computes (its one-sample path), so a seeded row
    draws the same token it drew when it was sampled alone. Only the noise of a seeded row is
    drawn per row: its stream is (seed, step) alone, from one generator reseeded per row."""
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
    noise = _exponential_noise(probs, drawn_params, [steps[b] for b in drawn])  # [S, V]
    tokens[index] = (probs / noise).argmax(dim=-1)
    return tokens


def _exponential_noise(
    probs: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
) -> torch.Tensor:
    """Exp(1) noise `[S, V]` like `probs`: a seeded row from its (seed, step) stream, the
    unseeded rows in one draw from torch's global generator."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    if unseeded:
        rows = torch.tensor(unseeded, dtype=torch.long, device=probs.device)
        noise[rows] = torch.empty_like(noise[rows]).exponential_(1.0)
    generator: torch.Generator | None = None
    for i, (p, step) in enumerate(zip(params, steps, strict=True)):
        if p.seed is None:
            continue
        if generator is None:  # one per call, reseeded per row: no shared state across threads
            generator = torch.Generator(device=probs.device)
        generator.manual_seed(_mix(p.seed, step))
        noise[i].exponential_(1.0, generator=generator)
    return noise


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
    """Zero outside each row's smallest top-p nucleus (rows whose top_p is 1 untouched)."""
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return probs
    index = torch.tensor(rows, dtype=torch.long, device=probs.device)
    threshold = torch.tensor([top_p[i] for i in rows], dtype=torch.float64, device=probs.device)
    picked = probs.index_select(0, index)  # [R, V]
    # Ranked by logit, which orders the probabilities too, and keeps that order where a huge
    # temperature rounds them to ties.
    order = torch.argsort(logits.index_select(0, index), dim=-1, descending=True)  # [R, V]
    ordered = picked.gather(-1, order)
    mass_before = torch.cumsum(ordered, dim=-1) - ordered  # exactly 0 for the best token
    drop = torch.zeros_like(picked, dtype=torch.bool)
    drop.scatter_(-1, order, mass_before >= threshold[:, None])
    out = probs.clone()
    out[index] = picked.masked_fill(drop, 0.0)
    return out


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
