"""`kvrelay bench model`: prefill throughput and decode latency of the model runtime at several
context lengths, for a full cache and for SnapKV-packed views keeping a fraction of the prompt
rows, next to `transformers`' own greedy generation of the same model and prompt.

The model is a random-init Llama (weights are irrelevant to speed) sized so that at long
context the KV cache, not the weights, dominates the bytes a decode step reads. Timings are
medians over the measured steps, after warm-up steps.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.kvpolicy.compress import StateIdentity, compress
from services.kvpolicy.manifest import default_manifests
from services.model.errors import InvalidModelInput
from services.model.kvcache import DecodeCache
from services.model.loader import LoadedModel, load
from services.model.runtime import PrefillOptions, PrefillResult, decode_step, prefill

WARMUP_STEPS = 2


@dataclass(frozen=True)
class BenchConfig:
    """One sweep. `fractions`: prompt rows kept per (layer, K/V head) by the packed views."""

    contexts: tuple[int, ...] = (1024, 4096, 16384)
    fractions: tuple[float, ...] = (0.25, 0.10)
    layers: int = 8
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_q_heads: int = 8
    num_kv_heads: int = 2
    vocab_size: int = 8192
    decode_steps: int = 32
    obs_window: int = 32
    chunk_size: int = 1024
    threads: int | None = None
    seed: int = 0
    reference: bool = True

    def __post_init__(self) -> None:
        if not self.contexts or min(self.contexts) <= self.obs_window:
            raise InvalidModelInput("bench.contexts", f"each must exceed obs_window={self.obs_window}")
        if not all(0.0 < f < 1.0 for f in self.fractions):
            raise InvalidModelInput("bench.fractions", "each must be in (0, 1)")
        if self.decode_steps <= 0:
            raise InvalidModelInput("bench.decode_steps", "must be positive")


@dataclass(frozen=True)
class ContextResult:
    """Measured numbers at one context length (times in ms, throughput in tokens/s)."""

    context: int
    prefill_tokens_per_s: float
    decode_ms: dict[str, float]  # "full" and "keep 25%", ... -> median ms/token
    kept_rows: dict[str, int]  # rows per request across all layers and heads
    reference_prefill_tokens_per_s: float | None = None
    reference_decode_ms: float | None = None
    greedy_tokens_match: bool | None = None


def run(config: BenchConfig, console: Console | None = None, json_out: Path | None = None) -> list[ContextResult]:
    """Run the sweep, print the model line and result tables, optionally write JSON."""
    console = console or Console()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as directory:
        reference = _save_random_llama(config, Path(directory))
        loaded = load(directory, dtype="float32")
        console.print(_describe(config, loaded))
        _warm_up(config, loaded, reference if config.reference else None)
        results = _sweep(config, loaded, reference if config.reference else None, console)
    console.print(_prefill_table(results))
    console.print(_decode_table(config, results))
    if json_out is not None:
        payload = {"config": asdict(config), "results": [asdict(r) for r in results]}
        json_out.write_text(json.dumps(payload, indent=2))
    return results


def _warm_up(config: BenchConfig, loaded: LoadedModel, reference: Any) -> None:
    # First calls pay one-time kernel selection and allocation; keep them out of the numbers.
    ids = torch.randint(0, config.vocab_size, (min(config.contexts),))
    prefill(loaded.model, ids, PrefillOptions(chunk_size=config.chunk_size // 2))
    if reference is not None:
        with torch.no_grad():
            reference(ids[None], logits_to_keep=1)


def _sweep(config: BenchConfig, loaded: LoadedModel, reference: Any, console: Console) -> list[ContextResult]:
    phases = 2 + len(config.fractions) + (1 if reference is not None else 0)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    results = []
    with Progress(*columns, console=console) as progress:
        sweep = progress.add_task("contexts", total=len(config.contexts))
        for context in config.contexts:
            task = progress.add_task(f"  T={context}", total=phases)
            results.append(_measure_context(config, loaded, reference, context,
                                            partial(progress.advance, task)))
            progress.advance(sweep)
    return results


def _measure_context(
    config: BenchConfig, loaded: LoadedModel, reference: Any, context: int, tick: Callable[[], None]
) -> ContextResult:
    generator = torch.Generator().manual_seed(config.seed + context)
    prompt = torch.randint(0, config.vocab_size, (context,), generator=generator)
    options = PrefillOptions(chunk_size=config.chunk_size, obs_window=config.obs_window)
    started = time.perf_counter()
    result = prefill(loaded.model, prompt, options)
    prefill_tokens_per_s = context / (time.perf_counter() - started)
    tick()
    full = DecodeCache(loaded.config, loaded.dtype, row_capacity=context + _total_steps(config) + 1)
    full.admit_dense("full", result.source_k, result.source_v)
    caches, kept = {"full": full}, {"full": context * _owners(loaded)}
    for fraction in config.fractions:
        label = f"keep {fraction:.0%}"
        caches[label], kept[label] = _packed_cache(loaded, result, fraction, config)
    race = DecodeRace(loaded, caches, int(result.logits.argmax()))
    if reference is None:
        for _ in range(_total_steps(config)):
            race.step()
        _tick(tick, 1 + len(config.fractions))
        return ContextResult(context, prefill_tokens_per_s, race.medians(), kept)
    ref_prefill_s, ref_ms, ref_tokens = _time_reference(reference, prompt, config, race)
    _tick(tick, 2 + len(config.fractions))
    return ContextResult(
        context, prefill_tokens_per_s, race.medians(), kept,
        reference_prefill_tokens_per_s=context / ref_prefill_s,
        reference_decode_ms=ref_ms,
        greedy_tokens_match=race.full_tokens == ref_tokens,
    )


def _tick(tick: Callable[[], None], times: int) -> None:
    for _ in range(times):
        tick()


def _packed_cache(
    loaded: LoadedModel, result: PrefillResult, fraction: float, config: BenchConfig
) -> tuple[DecodeCache, int]:
    # the served `snapkv` policy (uniform budgets, window protected) at `fraction`: the
    # compression core, then admit
    manifest = default_manifests(
        loaded.tensor_contract, budget_fraction=fraction, observation_window=config.obs_window
    )["snapkv"]
    view = compress(manifest, result, StateIdentity("bench", 1)).view
    longest = max(view.rows(layer, head).stop - view.rows(layer, head).start
                  for layer in range(view.num_layers) for head in range(view.num_kv_heads))
    cache = DecodeCache(loaded.config, loaded.dtype, row_capacity=longest + _total_steps(config) + 1)
    cache.admit_view("packed", view, frontier=result.prompt_length)
    return cache, view.total_rows


class DecodeRace:
    """Greedy decoding of the same request from several caches, one step each in turn, so
    load from other processes hits every contender alike. Times are per step, in seconds."""

    def __init__(self, loaded: LoadedModel, caches: dict[str, DecodeCache], first: int) -> None:
        self.loaded, self.caches = loaded, caches
        self.tokens = dict.fromkeys(caches, first)
        self.times: dict[str, list[float]] = {label: [] for label in caches}
        self.full_tokens = [first]

    def step(self) -> None:
        for label, cache in self.caches.items():
            started = time.perf_counter()
            logits = decode_step(self.loaded.model, cache, [self.tokens[label]])
            self.tokens[label] = int(logits[0].argmax())
            self.times[label].append(time.perf_counter() - started)
        self.full_tokens.append(self.tokens["full"])

    def medians(self) -> dict[str, float]:
        """Median ms per step after the warm-up steps."""
        return {label: 1000 * statistics.median(t[WARMUP_STEPS:]) for label, t in self.times.items()}


def _time_reference(
    reference: Any, prompt: torch.Tensor, config: BenchConfig, race: DecodeRace
) -> tuple[float, float, list[int]]:
    """transformers' greedy `generate`; a logits processor, called once per generated token,
    stamps HF's steps and runs one step of our race between them (interleaved timing)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    hf_steps: list[float] = []
    marks: dict[str, float] = {}

    class Interleave(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            now = time.perf_counter()
            if "last" in marks:
                hf_steps.append(now - marks["last"])
            else:
                marks["prefill"] = now - marks["start"]
            if len(hf_steps) < _total_steps(config):
                race.step()
            marks["last"] = time.perf_counter()
            return scores

    ids = prompt[None]
    marks["start"] = time.perf_counter()
    with torch.no_grad():
        out = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=_total_steps(config) + 1,
            do_sample=False, logits_processor=LogitsProcessorList([Interleave()]),
        )
    tokens = out[0, prompt.shape[0]:].tolist()
    return marks["prefill"], 1000 * statistics.median(hf_steps[WARMUP_STEPS:]), tokens


def _save_random_llama(config: BenchConfig, directory: Path) -> Any:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:  # transformers is a dev extra
        raise InvalidModelInput("bench.reference", "needs `transformers` (pip install kvrelay[dev])") from error
    torch.manual_seed(config.seed)
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.layers,
        num_attention_heads=config.num_q_heads, num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=max(config.contexts) + _total_steps(config) + 2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    reference = LlamaForCausalLM(hf_config).eval()
    reference.save_pretrained(directory, safe_serialization=True)
    return reference


def _describe(config: BenchConfig, loaded: LoadedModel) -> str:
    c = loaded.config
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    kv_per_token = c.num_layers * c.num_kv_heads * c.head_dim * 2 * loaded.dtype.itemsize
    return (
        f"model: random-init Llama, L={c.num_layers}, d_model={c.hidden_size}, d_ff={c.intermediate_size}, "
        f"H_q={c.num_q_heads}, H_kv={c.num_kv_heads}, d_h={c.head_dim}, vocab={c.vocab_size}, "
        f"{loaded.dtype}, weights {weights / 2**20:.0f} MiB, KV {kv_per_token / 1024:.0f} KiB/token "
        f"({kv_per_token * max(config.contexts) / 2**20:.0f} MiB at {max(config.contexts)})\n"
        f"device: cpu, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"prefill chunk {config.chunk_size}, W_obs {config.obs_window}; decode: median of "
        f"{config.decode_steps} greedy steps after {WARMUP_STEPS} warm-up; every cache and HF's "
        "generate take turns step by step\npacked views: SnapKV scores (sum over W_obs, max-pool 7, GQA mean), "
        "the same budget for every (layer, K/V head), observation window kept"
    )


def _prefill_table(results: list[ContextResult]) -> Table:
    table = Table(title="prefill (tokens/s)")
    for name in ("context", "kvrelay", "HF transformers", "kvrelay / HF"):
        table.add_column(name, justify="right")
    for r in results:
        ref = r.reference_prefill_tokens_per_s
        table.add_row(str(r.context), f"{r.prefill_tokens_per_s:,.0f}", _num(ref, "{:,.0f}"),
                      _num(ref and r.prefill_tokens_per_s / ref, "{:.2f}x"))
    return table


def _decode_table(config: BenchConfig, results: list[ContextResult]) -> Table:
    table = Table(title="decode, batch 1 (ms/token; ratios < 1: the numerator is faster)")
    labels = ["full"] + [f"keep {f:.0%}" for f in config.fractions]
    table.add_column("context", justify="right")
    for label in labels:
        table.add_column(label, justify="right")
    table.add_column("HF full", justify="right")
    table.add_column("full / HF", justify="right")
    for label in labels[1:]:
        table.add_column(f"{label.split()[-1]} / full", justify="right")
    table.add_column("= HF tokens", justify="center")
    for r in results:
        full, ref = r.decode_ms["full"], r.reference_decode_ms
        row = [str(r.context), *(f"{r.decode_ms[label]:.1f}" for label in labels),
               _num(ref, "{:.1f}"), _num(ref and full / ref, "{:.2f}")]
        row += [f"{r.decode_ms[label] / full:.2f}" for label in labels[1:]]
        row.append("-" if r.greedy_tokens_match is None else ("yes" if r.greedy_tokens_match else "no"))
        table.add_row(*row)
    return table


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _owners(loaded: LoadedModel) -> int:
    return loaded.config.num_layers * loaded.config.num_kv_heads


def _total_steps(config: BenchConfig) -> int:
    return config.decode_steps + WARMUP_STEPS
