"""The kvpress anchor: `SnapKVPress(compression_ratio=1 - budget)` on the transformers
model of the same checkpoint and prompt ids, in the transformers process.

Driven the way kvpress 0.5.5's `KVPressTextGenerationPipeline` drives it: the prompt
forward runs inside the press context manager, whose forward hooks replace each layer's
DynamicCache entries by the kept rows as the layer finishes; then greedy decoding feeds
one token per forward with explicit `position_ids` (T, T+1, ...), since the compressed
cache is shorter than the prompt (`generate_answer`). kvpress keeps the same number of
rows, max(1, int(T * (1 - compression_ratio))), in every (layer, K/V head): the cache stays
`[B, H_kv, T_kept, d_h]` per layer, scores are averaged over each K/V head's query-head
group, and the last `window_size` positions are kept (they get the maximum score + 1).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from services.benchmark.memory import PeakProbe
from services.benchmark.results import KVPRESS, DecodeRun
from services.benchmark.transformers_runner import cache_nbytes
from services.benchmark.worker import EngineJob


@torch.no_grad()
def measure_press(
    model: Any, job: EngineJob, name: str, context: int, budget: float, ids: tuple[int, ...]
) -> DecodeRun:
    """Prefill `ids` under SnapKVPress(compression_ratio=1 - budget), then decode greedily."""
    from kvpress import SnapKVPress
    from transformers import DynamicCache

    press = SnapKVPress(
        compression_ratio=1.0 - budget, window_size=job.obs_window, kernel_size=job.pooling_kernel
    )
    probe = PeakProbe()
    probe.start()
    cache = DynamicCache()
    started = time.perf_counter()
    with press(model):
        # kvpress's pipeline runs the prefill without the LM head and gets the first token
        # from its question; here the prompt's last position gives it (one LM-head row).
        logits = model(
            input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1
        ).logits
    prefill_s = time.perf_counter() - started
    prefill_memory = probe.stop()
    rows, nbytes = cache_nbytes(cache)
    probe.start()
    step_s, tokens = _decode(model, cache, int(logits[0, -1].argmax()), context, job.total_steps)
    return DecodeRun(
        model=name,
        engine=KVPRESS,
        context=context,
        budget=budget,
        prefill_s=prefill_s,
        step_s=step_s,
        warmup_steps=job.warmup_steps,
        tokens=tokens,
        kept_rows=rows,
        kv_bytes=nbytes,
        prefill_memory=prefill_memory,
        decode_memory=probe.stop(),
    )


def _decode(
    model: Any, cache: Any, first: int, context: int, steps: int
) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """kvpress's greedy loop: token i goes in at original position T + i."""
    tokens, step_s = [first], []
    for i in range(steps):
        started = time.perf_counter()
        logits = model(
            input_ids=torch.tensor([[tokens[-1]]]),
            past_key_values=cache,
            position_ids=torch.tensor([[context + i]]),
        ).logits  # [1, 1, V]
        tokens.append(int(logits[0, -1].argmax()))
        step_s.append(time.perf_counter() - started)
    return tuple(step_s), tuple(tokens)
