"""In-process compressed generation: the prefill worker's stages, then the decode worker's path.

`compress_prompt` runs the prompt forward and the compression core
(`services.kvpolicy.compress`: score → allocate → select → pack), exactly as the prefill
worker does; `admit` puts the packed view into a runtime `DecodeCache` the way the decode
worker's scheduler does (one request, owners per the manifest's GQA reduction); `decode`
continues from the prefill's first token with `decode_step` and `sample`. Nothing crosses a
process: no policy service, no transfer. Quality measured here is the quality a served
request gets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.kvpolicy.compress import (
    Compressed,
    Selection,
    StateIdentity,
    compress,
    observation_window,
)
from services.kvpolicy.head_profile import HeadProfile, profile_tensor
from services.kvpolicy.ledger import Ledger
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.kvpolicy.packing import PackedKVView
from services.model import (
    DecodeCache,
    InvalidModelInput,
    LoadedModel,
    PrefillOptions,
    PromptForward,
    SamplingParams,
    decode_step,
    finish_reason,
    forward_prompt,
    sample,
)

REQUEST_ID = "in-process"
IN_PROCESS = StateIdentity(REQUEST_ID, request_generation=1)


@dataclass(frozen=True)
class CompressedPrompt:
    """A prompt after the prefill stages: its forward and its compression."""

    manifest: KVVisibilityPolicyManifest
    forward: PromptForward
    compressed: Compressed

    @property
    def selection(self) -> Selection:
        return self.compressed.selection

    @property
    def view(self) -> PackedKVView:
        return self.compressed.view

    @property
    def ledger(self) -> Ledger:
        return self.compressed.ledger


@dataclass(frozen=True)
class CompressedGeneration:
    """Generated tokens (the first one sampled at prefill) and the view they were decoded over."""

    tokens: tuple[int, ...]
    prompt: CompressedPrompt

    @property
    def view(self) -> PackedKVView:
        return self.prompt.view

    @property
    def ledger(self) -> Ledger:
        return self.prompt.ledger


def forward_for(
    loaded: LoadedModel,
    manifest: KVVisibilityPolicyManifest,
    prompt_ids: Sequence[int],
    sampling: SamplingParams = SamplingParams(),
    chunk_size: int = 512,
) -> PromptForward:
    """The prompt forward the prefill worker runs for `manifest` (its observation window,
    whose vote alone is kept, as there)."""
    options = PrefillOptions(
        chunk_size=chunk_size, obs_window=observation_window(manifest), keep_observation=False
    )
    return forward_prompt(loaded.model, [int(t) for t in prompt_ids], sampling, options)


def compress_prompt(
    loaded: LoadedModel,
    manifest: KVVisibilityPolicyManifest,
    prompt_ids: Sequence[int],
    head_profile: HeadProfile | None = None,
    *,
    sampling: SamplingParams = SamplingParams(),
    chunk_size: int = 512,
    shared_forward: PromptForward | None = None,
) -> CompressedPrompt:
    """forward → score → allocate → select → pack, as the prefill worker runs them.

    `shared_forward` reuses one prompt forward for several manifests (the quality sweep): it
    must have captured this manifest's observation window (static policies need none).
    """
    fwd = shared_forward or forward_for(loaded, manifest, prompt_ids, sampling, chunk_size)
    _check_forward(manifest, fwd, len(prompt_ids))
    profile = profile_tensor(manifest, head_profile)
    compressed = compress(manifest, fwd.result, IN_PROCESS, profile=profile)
    return CompressedPrompt(manifest, fwd, compressed)


def admit(loaded: LoadedModel, prompt: CompressedPrompt, extra_rows: int = 1) -> DecodeCache:
    """A single-request DecodeCache holding the packed view, as the decode worker admits it."""
    manifest = prompt.manifest
    owner_map = manifest.expanded_owner_map
    cache = DecodeCache(
        loaded.config, loaded.dtype, loaded.device, batch_capacity=1,
        row_capacity=prompt.forward.prompt_len + extra_rows + 1, owner_to_kv_head=owner_map,
    )
    cache.admit_view(REQUEST_ID, prompt.view, frontier=prompt.forward.prompt_len)
    return cache


def decode(
    loaded: LoadedModel,
    cache: DecodeCache,
    first_token: int,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
) -> list[int]:
    """Output tokens from `first_token` (output 0) until EOS, a stop id or `max_new_tokens`."""
    eos = loaded.generation_config.eos_token_ids
    tokens = [first_token]
    while finish_reason(tokens[-1], len(tokens), max_new_tokens, sampling, eos) is None:
        logits = decode_step(loaded.model, cache, [tokens[-1]])  # [1, V]
        tokens.append(int(sample(logits, [sampling], [len(tokens)])[0]))
    return tokens


def feed(loaded: LoadedModel, cache: DecodeCache, token_ids: Sequence[int]) -> torch.Tensor:
    """Decode given tokens one step each (teacher forcing); the last step's logits `[V]`."""
    if not token_ids:
        raise InvalidModelInput("token_ids", "must not be empty")
    logits = torch.empty(0)
    for token in token_ids:
        logits = decode_step(loaded.model, cache, [int(token)])[0]
    return logits


def compressed_generate(
    loaded: LoadedModel,
    manifest: KVVisibilityPolicyManifest,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    head_profile: HeadProfile | None = None,
    sampling: SamplingParams = SamplingParams(),
    chunk_size: int = 512,
) -> CompressedGeneration:
    """Generate under `manifest` in-process: prefill stages, then decode over the packed view.

    With manifest `full` this is token for token the runtime's full-cache `generate`.
    """
    if max_new_tokens < 0:
        raise InvalidModelInput("max_new_tokens", "must be >= 0")
    prompt = compress_prompt(
        loaded, manifest, prompt_ids, head_profile, sampling=sampling, chunk_size=chunk_size
    )
    if max_new_tokens == 0:
        return CompressedGeneration((), prompt)
    cache = admit(loaded, prompt, extra_rows=max_new_tokens)
    tokens = decode(loaded, cache, prompt.forward.first_token, max_new_tokens, sampling)
    return CompressedGeneration(tuple(tokens), prompt)


def _check_forward(
    manifest: KVVisibilityPolicyManifest, fwd: PromptForward, prompt_len: int
) -> None:
    if fwd.prompt_len != prompt_len:
        raise InvalidModelInput(
            "shared_forward", f"covers {fwd.prompt_len} tokens, the prompt has {prompt_len}"
        )
    wanted = min(observation_window(manifest), prompt_len)
    voted = fwd.result.observation_vote
    captured = 0 if voted is None else voted.window
    if wanted and captured != wanted:
        raise InvalidModelInput(
            "shared_forward",
            f"captured an observation window of {captured}, {manifest.name} scores with {wanted}",
        )
