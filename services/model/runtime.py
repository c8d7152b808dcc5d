"""The two stages the workers run, plus a full-cache convenience loop.

- `prefill`: the whole prompt, layer by layer in query chunks, returning source K/V
  `[L, H_kv, T, d_h]` (keys post-RoPE at original positions), observation-window attention
  `[L, H_q, W_obs, T]` and the next-token logits. `on_layer` sees each layer as soon as it is
  done (the hook for layer-by-layer sending).
- `forward_prompt`: `prefill`, then output token 0 sampled from its logits.
- `decode_step`: one token for every request of a `DecodeCache` batch.
- `generate`: prefill -> admit every position -> decode until a stop condition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.kvpolicy.snapkv import window_vote
from services.model.attention import Attend, causal_chunk_attention, observation_attention
from services.model.errors import InvalidModelInput
from services.model.kvcache import DecodeCache, StepCapture
from services.model.loader import LoadedModel
from services.model.model import CausalLM, DecoderLayer
from services.model.sampler import SamplingParams, finish_reason, sample


@dataclass(frozen=True)
class PrefillOptions:
    """chunk_size: queries per attention/MLP chunk (bounds peak memory); obs_window: W_obs,
    the number of trailing queries whose attention rows are captured (0 = none);
    keep_observation: whether the result holds those rows `[L, H_q, W_obs, T]` besides their
    vote (`ObservationVote`, which is all scoring needs: the prefill worker keeps only it,
    4 L H_q W_obs T bytes fewer per prompt — 400 MB at 16K tokens, 24 layers, 16 heads)."""

    chunk_size: int = 512
    obs_window: int = 32
    keep_observation: bool = True

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise InvalidModelInput("prefill.chunk_size", "must be positive")
        if self.obs_window < 0:
            raise InvalidModelInput("prefill.obs_window", "must be >= 0")


@dataclass(frozen=True)
class LayerPrefill:
    """One finished layer of a prefill, handed to `on_layer` before the next layer runs."""

    layer: int
    source_k: torch.Tensor  # [H_kv, T, d_h]
    source_v: torch.Tensor  # [H_kv, T, d_h]
    observation: torch.Tensor  # [H_q, W_obs, T] fp32


@dataclass(frozen=True)
class ObservationVote:
    """The observation window reduced layer by layer while each layer's probabilities are
    fresh (`services.kvpolicy.snapkv.WindowVote`): `vote` `[L, H_q, T - W]` fp32, the sum over
    the W window queries of their probabilities on the prefix keys (`snapkv.window_vote`, the
    same bits as summing the kept observation), and each layer's smallest and largest
    probability `[L]` fp32, which scoring checks instead of reading the observation again."""

    window: int
    vote: torch.Tensor
    minimum: torch.Tensor
    maximum: torch.Tensor


@dataclass(frozen=True)
class PrefillResult:
    """Everything the prefill worker scores, selects and packs from."""

    logits: torch.Tensor  # [V] fp32, next-token distribution after the last prompt token
    source_k: torch.Tensor  # [L, H_kv, T, d_h]
    source_v: torch.Tensor  # [L, H_kv, T, d_h]
    # [L, H_q, W_obs, T] fp32, W_obs = min(obs_window, T); None unless `keep_observation`
    observation: torch.Tensor | None
    observation_vote: ObservationVote | None = None  # None when no window is captured

    @property
    def prompt_length(self) -> int:
        return self.source_k.shape[2]


@dataclass(frozen=True)
class PromptForward:
    """A prompt's prefill and output token 0, sampled from its last logits: the first output
    token is sampled at the end of prefill and travels with the transfer (DESIGN §2)."""

    result: PrefillResult
    first_token: int

    @property
    def prompt_len(self) -> int:
        return self.result.prompt_length


def forward_prompt(
    model: CausalLM,
    prompt_ids: Sequence[int] | torch.Tensor,
    sampling: SamplingParams,
    options: PrefillOptions,
) -> PromptForward:
    """Full prompt forward (observation capture per `options`), then sample output token 0."""
    result = prefill(model, prompt_ids, options)
    first = sample(result.logits[None], [sampling], [0])  # [1]
    return PromptForward(result, int(first[0]))


@torch.no_grad()
def prefill(
    model: CausalLM,
    prompt_ids: Sequence[int] | torch.Tensor,
    options: PrefillOptions = PrefillOptions(),
    on_layer: Callable[[LayerPrefill], None] | None = None,
) -> PrefillResult:
    """Full causal forward over one prompt, layer-outer and chunk-inner."""
    config, device = model.config, model.lm_head.weight.device
    ids = _token_tensor(prompt_ids, config.vocab_size, device)
    length, scale = ids.shape[0], model.scale
    window_rows = min(options.obs_window, length)
    kv_shape = (config.num_layers, config.num_kv_heads, length, config.head_dim)
    keys = torch.empty(kv_shape, dtype=model.lm_head.weight.dtype, device=device)
    values = torch.empty_like(keys)
    observation = (
        torch.empty((config.num_layers, config.num_q_heads, window_rows, length), device=device)
        if options.keep_observation else None
    )
    voting = _VoteBuffers.empty(config.num_layers, config.num_q_heads, window_rows, length, device)
    x = model.model.embed_tokens(ids)  # [T, D]
    cos, sin = model.rope(torch.arange(length, device=device), x.dtype)  # [T, d_h]
    for index, layer in enumerate(model.model.blocks()):
        rows = _prefill_layer(
            layer, x, cos, sin, keys[index], values[index], window_rows,
            config.sliding_windows[index], options.chunk_size, scale,
        )
        if observation is not None:
            observation[index] = rows
        if voting is not None:
            voting.reduce(index, rows)
        if on_layer is not None:
            on_layer(LayerPrefill(index, keys[index], values[index], rows))
        del rows
    logits = model.logits(x[-1:])[0]
    return PrefillResult(
        logits=logits, source_k=keys, source_v=values, observation=observation,
        observation_vote=None if voting is None else voting.result(),
    )


@dataclass(frozen=True)
class _VoteBuffers:
    """Where `prefill` reduces each layer's observation rows (`ObservationVote`)."""

    window: int
    vote: torch.Tensor  # [L, H_q, T - W]
    extremes: torch.Tensor  # [2, L]: minimum, maximum

    @classmethod
    def empty(cls, layers: int, heads: int, window: int, length: int,
              device: torch.device) -> _VoteBuffers | None:
        if window == 0:
            return None
        vote = torch.empty((layers, heads, length - window), device=device)
        return cls(window, vote, torch.empty((2, layers), device=device))

    def reduce(self, layer: int, rows: torch.Tensor) -> None:
        self.vote[layer] = window_vote(rows, int(self.vote.shape[-1]))
        low, high = torch.aminmax(rows)
        self.extremes[0, layer], self.extremes[1, layer] = low, high

    def result(self) -> ObservationVote:
        return ObservationVote(self.window, self.vote, self.extremes[0], self.extremes[1])


def observation_vote(observation: torch.Tensor) -> ObservationVote:
    """The vote `prefill` hands over for a kept observation `[L, H_q, W, T]` (W > 0), layer
    by layer through the same reduction (what the benchmarks and tests feed compression)."""
    layers, heads, window, length = (int(x) for x in observation.shape)
    voting = _VoteBuffers.empty(layers, heads, window, length, observation.device)
    if voting is None:
        raise InvalidModelInput("observation", "no window rows to vote with")
    for layer in range(layers):
        voting.reduce(layer, observation[layer])
    return voting.result()


def _prefill_layer(
    layer: DecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    window_rows: int,
    window: int | None,
    chunk_size: int,
    scale: float,
) -> torch.Tensor:
    """Run one layer over x `[T, D]` in place, chunk by chunk, filling keys/values
    `[H_kv, T, d_h]`; returns the observation attention `[H_q, W_obs, T]`."""
    length = x.shape[0]
    q_obs = x.new_empty((layer.self_attn.num_heads, window_rows, keys.shape[2]))  # [H_q, W_obs, d_h]
    for start in range(0, length, chunk_size):
        stop = min(start + chunk_size, length)
        attend = _chunk_attend(keys, values, q_obs, start, window, scale)
        x[start:stop] = layer(x[start:stop], cos[start:stop], sin[start:stop], attend)
    q_positions = torch.arange(length - window_rows, length, device=x.device)
    return observation_attention(q_obs, keys, q_positions, window, scale)


def _chunk_attend(
    keys: torch.Tensor,
    values: torch.Tensor,
    q_obs: torch.Tensor,
    start: int,
    window: int | None,
    scale: float,
) -> Attend:
    # keys/values [H_kv, T, d_h] of this layer; q_obs [H_q, W_obs, d_h] collects trailing queries
    obs_start = keys.shape[1] - q_obs.shape[1]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        stop = start + q.shape[0]
        keys[:, start:stop] = k.transpose(0, 1)
        values[:, start:stop] = v.transpose(0, 1)
        first = max(start, obs_start)
        if first < stop:
            q_obs[:, first - obs_start : stop - obs_start] = q[first - start :].transpose(0, 1)
        return causal_chunk_attention(
            q, keys[:, :stop], values[:, :stop], start, window, scale
        )

    return attend


@torch.no_grad()
def decode_step(
    model: CausalLM,
    cache: DecodeCache,
    tokens: Sequence[int] | torch.Tensor,
    capture: StepCapture | None = None,
) -> torch.Tensor:
    """Feed one token per request (in `cache.request_ids` order) at each request's frontier;
    append its K/V row to every owner; return next-token logits `[B, V]` (fp32). `capture`
    (recall) receives every layer's queries and log-sum-exps."""
    ids = _token_tensor(tokens, model.config.vocab_size, cache.device)
    if ids.shape[0] != cache.batch_size:
        raise InvalidModelInput("tokens", f"got {ids.shape[0]}, batch has {cache.batch_size}")
    positions = cache.begin_step(capture)
    logits = model(ids, positions, cache.attention)
    cache.end_step()
    return logits


def generate(
    loaded: LoadedModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    options: PrefillOptions = PrefillOptions(obs_window=0),
) -> list[int]:
    """Full-cache generation for one prompt (greedy by default). The returned tokens include
    the EOS / stop token that ended generation, if any."""
    if max_new_tokens < 0:
        raise InvalidModelInput("max_new_tokens", "must be >= 0")
    if max_new_tokens == 0:
        return []
    result = prefill(loaded.model, prompt_ids, options)
    cache = DecodeCache(
        loaded.config, loaded.dtype, loaded.device,
        batch_capacity=1, row_capacity=result.prompt_length + max_new_tokens + 1,
    )
    cache.admit_dense("generate", result.source_k, result.source_v)
    return decode_tokens(loaded, cache, result.logits[None], max_new_tokens, sampling)


def decode_tokens(
    loaded: LoadedModel,
    cache: DecodeCache,
    logits: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingParams,
) -> list[int]:
    """Sample from `logits` `[1, V]` and keep decoding the cache's single request until EOS,
    a stop id or `max_new_tokens`."""
    eos = loaded.generation_config.eos_token_ids
    tokens: list[int] = []
    while True:
        token = int(sample(logits, [sampling], [len(tokens)])[0])
        tokens.append(token)
        if finish_reason(token, len(tokens), max_new_tokens, sampling, eos) is not None:
            return tokens
        logits = decode_step(loaded.model, cache, [token])


def _token_tensor(
    ids: Sequence[int] | torch.Tensor, vocab_size: int, device: torch.device
) -> torch.Tensor:
    tensor = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(device)
    if tensor.numel() == 0:
        raise InvalidModelInput("token_ids", "must not be empty")
    low, high = int(tensor.min()), int(tensor.max())
    if low < 0 or high >= vocab_size:
        raise InvalidModelInput("token_ids", f"ids must be in [0, {vocab_size}), got {low}..{high}")
    return tensor
