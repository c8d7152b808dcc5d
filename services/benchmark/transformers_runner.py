"""The anchors' process: transformers' greedy `generate` with its own DynamicCache and, on
the same model object, kvpress's SnapKVPress (`services.benchmark.kvpress_runner`).

It runs first: it writes the random-init checkpoints with `save_pretrained`, so every
engine (kvrelay included) loads the very same files. Timing of `generate`: a logits
processor is called once per generated token; the gap between two calls is one decode
step (the forward plus generate's own bookkeeping), the time to the first call is the
prefill. The first call also ends the prefill's memory phase and starts the decode's.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

from services.benchmark.memory import PeakProbe
from services.benchmark.models import save_random_llama
from services.benchmark.results import TRANSFORMERS, DecodeRun, PhaseMemory
from services.benchmark.worker import EngineJob, ModelJob, Reporter


def run(job: EngineJob, report: Reporter) -> None:
    """Write the random checkpoints, then measure transformers (and kvpress) per model."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.set_num_threads(job.threads)
    if job.kvpress:
        import kvpress  # noqa: F401  (resident before the first phase, so every phase counts it alike)
    for random in job.random_models:
        save_random_llama(random.shape, random.checkpoint, random.max_positions, random.seed)
    report.tick("random-init checkpoints written")
    for model_job in job.models:
        _measure_model(job, model_job, report)
        gc.collect()


def _measure_model(job: EngineJob, model_job: ModelJob, report: Reporter) -> None:
    model = load_hf_model(model_job.checkpoint)
    for context, ids in model_job.prompts:
        report.result(_generate(model, job, model_job.name, context, ids))
        report.tick(f"{model_job.name} T={context}: transformers")
        if job.kvpress:
            from services.benchmark.kvpress_runner import measure_press

            for budget in job.compressed_budgets:
                report.result(measure_press(model, job, model_job.name, context, budget, ids))
                report.tick(f"{model_job.name} T={context}: kvpress {budget:.0%}")


def load_hf_model(checkpoint: Path) -> Any:
    """The checkpoint as a transformers causal LM in float32, eval mode, no EOS stopping."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every engine decodes the same number of steps
    return model


def cache_nbytes(cache: Any) -> tuple[int, int]:
    """(rows summed over layers and K/V heads, bytes of K plus V) of a DynamicCache."""
    rows = nbytes = 0
    for layer in cache.layers:
        keys, values = layer.keys, layer.values  # [B, H_kv, T_kept, d_h]
        rows += keys.shape[1] * keys.shape[2]
        nbytes += keys.nbytes + values.nbytes
    return rows, nbytes


class _StepClock:
    """Stamps every call; the first one closes the prefill's memory phase."""

    def __init__(self, probe: PeakProbe) -> None:
        self.probe = probe
        self.started = time.perf_counter()
        self.stamps: list[float] = []
        self.prefill_memory: PhaseMemory | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        now = time.perf_counter()
        if not self.stamps:
            self.prefill_memory = self.probe.stop()
            self.probe.start()
        self.stamps.append(now)
        return scores


def _generate(
    model: Any, job: EngineJob, name: str, context: int, ids: tuple[int, ...]
) -> DecodeRun:
    from transformers import LogitsProcessorList

    probe = PeakProbe()
    probe.start()
    clock = _StepClock(probe)
    prompt = torch.tensor([ids])  # [1, T]
    output = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=job.total_steps + 1,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
        return_dict_in_generate=True,
    )
    decode_memory = probe.stop()
    assert clock.prefill_memory is not None, "generate produced no token"
    rows, nbytes = cache_nbytes(output.past_key_values)
    cached = output.sequences.shape[1] - 1  # the last token's K/V is never computed
    stamps = clock.stamps
    return DecodeRun(
        model=name,
        engine=TRANSFORMERS,
        context=context,
        budget=1.0,
        prefill_s=stamps[0] - clock.started,
        step_s=tuple(b - a for a, b in zip(stamps, stamps[1:], strict=False)),
        warmup_steps=job.warmup_steps,
        tokens=tuple(output.sequences[0, context:].tolist()),
        kept_rows=rows * context // cached,
        kv_bytes=nbytes * context // cached,
        prefill_memory=clock.prefill_memory,
        decode_memory=decode_memory,
    )
