"""Token sampling (greedy, temperature, top-k, top-p) and stop decisions. Pure functions over
logits. The randomness of output token i of a seeded request comes from a generator seeded with
(seed, i) alone, so the same tokens come out whichever worker samples them (the first token is
sampled by the prefill worker, the rest by the decode worker) and whatever shares the batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.model.errors import InvalidModelInput

FINISH_EOS = "eos"
FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidModelInput("sampling.temperature", "must be >= 0")
        if self.top_k < 0:
            raise InvalidModelInput("sampling.top_k", "must be >= 0 (0 disables)")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidModelInput("sampling.top_p", "must be in (0, 1]")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidModelInput("sampling.stop_token_ids", "token ids are non-negative")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def step_generator(
    params: SamplingParams, step: int, device: torch.device
) -> torch.Generator | None:
    """The generator for output token `step` (0-based) of a seeded request; None when greedy
    or unseeded (unseeded sampling draws from torch's global generator)."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(_mix(params.seed, step))
    return generator


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
) -> torch.Tensor:
    """logits `[B, V]` -> token ids `[B]`; row b is output token steps[b] of a request
    sampled with params[b]."""
    if len(params) != logits.shape[0] or len(steps) != logits.shape[0]:
        raise InvalidModelInput("sampling", "need one SamplingParams and step per logits row")
    tokens = [
        _sample_row(row, p, step_generator(p, step, logits.device))
        for row, p, step in zip(logits, params, steps, strict=True)
    ]
    return torch.stack(tokens)


def _sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    if params.greedy:
        return logits.argmax()
    probs = torch.softmax(filter_logits(logits.float() / params.temperature, params), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]


def _mix(seed: int, step: int) -> int:
    # splitmix64 of (seed, step): neighbouring steps and seeds get unrelated streams.
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Set to -inf every token outside the top-k and outside the smallest top-p nucleus `[V]`."""
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # the best token always survives
        drop = torch.zeros_like(logits, dtype=torch.bool)
        drop[order] = mass_before >= params.top_p
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


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
