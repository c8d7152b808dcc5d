"""kvrelay's side of the bench, run in its own process: the prefill worker's stages
(the prompt forward, then score -> allocate -> select -> pack: `services.kvpolicy.compress`),
then greedy decoding from a `DecodeCache` admitted from the dense prefill K/V (full cache)
or from each packed view (SnapKV at each budget; budget 1.0 packs every row).

Between the two sides the source K/V and the views wait on disk, as they would travel to a
decode worker: each decode configuration's memory is measured with only its own cache
resident. Each compression's peak RSS is measured on its own too, beside the transaction
peak its ledger states (`TransactionPeak`).
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from services.benchmark.memory import PeakProbe
from services.benchmark.results import (
    KVRELAY_FULL,
    KVRELAY_SNAPKV,
    DecodeRun,
    ModelFacts,
    PhaseMemory,
    TransactionPeak,
)
from services.benchmark.worker import EngineJob, Reporter
from services.evaluation.generation import IN_PROCESS, forward_for
from services.kvpolicy.compress import compress
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, default_manifests
from services.kvpolicy.packing import PackedKVView
from services.model import DecodeCache, LoadedModel, PromptForward, decode_step, load


def run(job: EngineJob, report: Reporter) -> None:
    """Measure every (model, context, cache configuration) of `job`, one model at a time;
    each model's ModelFacts go first."""
    torch.set_num_threads(job.threads)
    for model_job in job.models:
        loaded = load(model_job.checkpoint, dtype="float32")
        _page_in(loaded)
        report.result(model_facts(model_job.name, loaded))
        manifests = {budget: snapkv_manifest(loaded, budget, job) for budget in job.budgets}
        for context, ids in model_job.prompts:
            for record in _measure_context(
                loaded, manifests, job, model_job.name, context, ids, report
            ):
                report.result(record)
        del loaded
        gc.collect()


def _page_in(loaded: LoadedModel) -> None:
    """Read every weight once before anything is measured: safetensors load memory-mapped,
    and pages first touched by the first prompt's forward would count as its memory."""
    for parameter in loaded.model.parameters():
        parameter.sum()


def model_facts(name: str, loaded: LoadedModel) -> ModelFacts:
    """Sizes of the loaded model; a step reads every matrix except the embedding table
    (one row of it), unless the LM head shares that table."""
    c = loaded.config
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    embedding = loaded.model.model.embed_tokens.weight
    read = (
        weights if c.tie_word_embeddings else weights - embedding.numel() * embedding.element_size()
    )
    kv_per_token = loaded.tensor_contract.bytes_per_token
    description = (
        f"L={c.num_layers}, d_model={c.hidden_size}, d_ff={c.intermediate_size}, "
        f"H_q={c.num_q_heads}, H_kv={c.num_kv_heads}, d_h={c.head_dim}, vocab={c.vocab_size}, "
        f"float32; weights {weights / 2**20:.1f} MiB, KV {kv_per_token / 1024:.1f} KiB/token"
    )
    return ModelFacts(
        name=name,
        description=description,
        weight_bytes=weights,
        weight_bytes_read_per_step=read,
        kv_bytes_per_token=kv_per_token,
        num_layers=c.num_layers,
        num_q_heads=c.num_q_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype="float32",
    )


def snapkv_manifest(
    loaded: LoadedModel, budget: float, job: EngineJob
) -> KVVisibilityPolicyManifest:
    """The default `snapkv` policy (uniform allocation, observation window kept, avg pooling,
    sum over the window, GQA mean) at `budget` of the prompt rows per K/V head."""
    manifest = default_manifests(
        loaded.tensor_contract, budget_fraction=budget, observation_window=job.obs_window
    )["snapkv"]
    selection = manifest.selection
    assert selection.snapkv is not None  # the snapkv policy always carries its parameters
    snapkv = replace(selection.snapkv, pooling_kernel=job.pooling_kernel)
    return replace(manifest, selection=replace(selection, snapkv=snapkv))


def _measure_context(
    loaded: LoadedModel,
    manifests: dict[float, KVVisibilityPolicyManifest],
    job: EngineJob,
    model: str,
    context: int,
    ids: tuple[int, ...],
    report: Reporter,
) -> list[DecodeRun]:
    scratch = job.scratch / f"kvrelay-{model}-{context}"
    scratch.mkdir(parents=True, exist_ok=True)
    side = _prefill_side(loaded, manifests, job, ids, scratch)
    report.tick(f"{model} T={context}: kvrelay prefill + compression")

    def decode(engine: str, budget: float, cache: tuple[DecodeCache, int, int]) -> DecodeRun:
        step_s, tokens, memory = _decode(loaded, cache[0], side.first_token, job.total_steps)
        report.tick(f"{model} T={context}: {engine} {budget:.0%}")
        compressed = engine == KVRELAY_SNAPKV
        return DecodeRun(
            model=model,
            engine=engine,
            context=context,
            budget=budget,
            prefill_s=side.prefill_s,
            step_s=step_s,
            warmup_steps=job.warmup_steps,
            tokens=tokens,
            kept_rows=cache[1],
            kv_bytes=cache[2],
            prefill_memory=side.memory,
            decode_memory=memory,
            compression_s=side.stages.get(budget, {}) if compressed else {},
            transaction=side.transactions.get(budget) if compressed else None,
        )

    runs = [decode(KVRELAY_FULL, 1.0, _dense_cache(loaded, scratch, job.total_steps))]
    for budget in manifests:
        view = _view_cache(loaded, scratch, budget, context, job.total_steps)
        runs.append(decode(KVRELAY_SNAPKV, budget, view))
    shutil.rmtree(scratch)
    return runs


@dataclass(frozen=True)
class _PrefillSide:
    """One prompt's prefill side: the forward's time and token 0, each budget's stage times
    and transaction peak, and the memory of forward and compressions together."""

    prefill_s: float
    first_token: int
    stages: dict[float, dict[str, float]]
    transactions: dict[float, TransactionPeak]
    memory: PhaseMemory


def _prefill_side(
    loaded: LoadedModel,
    manifests: dict[float, KVVisibilityPolicyManifest],
    job: EngineJob,
    ids: tuple[int, ...],
    scratch: Path,
) -> _PrefillSide:
    """forward once, then score -> allocate -> select -> pack per budget (each stage timed,
    each compression's peak measured on its own); the dense K/V and every view go to
    `scratch`. Memory: forward and compressions."""
    probe = PeakProbe()
    probe.start()
    started = time.perf_counter()
    fwd = forward_for(loaded, next(iter(manifests.values())), ids, chunk_size=job.chunk_size)
    prefill_s = time.perf_counter() - started
    forward_memory = probe.stop()
    stages, transactions = {}, {}
    for budget, manifest in manifests.items():
        stages[budget], transactions[budget], view = _compress(manifest, fwd, forward_memory.start)
        _save(scratch / f"view-{budget}.pt", _view_tensors(view))
        del view
    _save(scratch / "dense.pt", {"k": fwd.result.source_k, "v": fwd.result.source_v})
    memory = _joined(forward_memory, (t.compression for t in transactions.values()))
    return _PrefillSide(prefill_s, fwd.first_token, stages, transactions, memory)


def _compress(
    manifest: KVVisibilityPolicyManifest, fwd: PromptForward, before_forward: int
) -> tuple[dict[str, float], TransactionPeak, PackedKVView]:
    """The compression core on the shared forward, each stage timed (`score`, `allocate`,
    `select`, `pack`), its peak RSS measured from `before_forward` (the RSS before the
    prompt's forward, so the source cache and observation it left count as the ledger
    counts them)."""
    times: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(stage: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        times[stage.removeprefix("kv.")] = time.perf_counter() - started

    probe = PeakProbe()
    probe.start()
    compressed = compress(manifest, fwd.result, IN_PROCESS, observe=timed)
    measured = probe.stop()
    ledger = compressed.ledger
    transaction = TransactionPeak(
        ledger_peak=ledger.transaction_peak_bytes,
        phases=ledger.transaction_phases,
        compression=PhaseMemory(start=before_forward, peak=measured.peak, scope=measured.scope),
    )
    return times, transaction, compressed.view


def _joined(first: PhaseMemory, others: Iterable[PhaseMemory]) -> PhaseMemory:
    """One phase made of `first` and the phases after it (the highest peak of all)."""
    phases = [first, *others]
    scope = first.scope if all(p.scope == first.scope for p in phases) else "process"
    return PhaseMemory(start=first.start, peak=max(p.peak for p in phases), scope=scope)


def _dense_cache(loaded: LoadedModel, scratch: Path, steps: int) -> tuple[DecodeCache, int, int]:
    """The full cache: every prompt position of every (layer, K/V head)."""
    dense = torch.load(scratch / "dense.pt", weights_only=True)
    keys, values = dense.pop("k"), dense.pop("v")  # [L, H_kv, T, d_h]
    cache = _new_cache(loaded, keys.shape[2] + steps + 1)
    cache.admit_dense("bench", keys, values)
    rows, nbytes = keys.shape[0] * keys.shape[1] * keys.shape[2], keys.nbytes + values.nbytes
    return cache, rows, nbytes


def _view_cache(
    loaded: LoadedModel, scratch: Path, budget: float, context: int, steps: int
) -> tuple[DecodeCache, int, int]:
    """A cache admitted from the packed view of `budget` (rows keep their original positions)."""
    view = PackedKVView(**torch.load(scratch / f"view-{budget}.pt", weights_only=True))
    longest = max(
        view.rows(layer, head).stop - view.rows(layer, head).start
        for layer in range(view.num_layers)
        for head in range(view.num_kv_heads)
    )
    cache = _new_cache(loaded, longest + steps + 1)
    cache.admit_view("bench", view, frontier=context)
    return cache, view.total_rows, view.payload_bytes


def _new_cache(loaded: LoadedModel, rows: int) -> DecodeCache:
    return DecodeCache(
        loaded.config, loaded.dtype, loaded.device, batch_capacity=1, row_capacity=rows
    )


def _decode(
    loaded: LoadedModel, cache: DecodeCache, first: int, steps: int
) -> tuple[tuple[float, ...], tuple[int, ...], PhaseMemory]:
    """Greedy decoding, one timed step per token; memory covers the decode steps only."""
    probe = PeakProbe()
    probe.start()
    tokens, step_s = [first], []
    for _ in range(steps):
        started = time.perf_counter()
        logits = decode_step(loaded.model, cache, [tokens[-1]])  # [1, V]
        tokens.append(int(logits[0].argmax()))
        step_s.append(time.perf_counter() - started)
    return tuple(step_s), tuple(tokens), probe.stop()


def _view_tensors(view: PackedKVView) -> dict[str, torch.Tensor]:
    return {
        "packed_k": view.packed_k,
        "packed_v": view.packed_v,
        "original_position_map": view.original_position_map,
        "row_offsets": view.row_offsets,
    }


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    torch.save(tensors, path)
