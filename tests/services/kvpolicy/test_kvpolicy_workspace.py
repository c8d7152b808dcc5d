"""The transaction's workspace terms against what the code allocates: a real prefill of a tiny
random Llama, each compression stage run under torch's CPU allocator accounting (the
profiler's memory events), and the ledger's terms compared with the byte counts of the actual
tensors and with the most bytes each stage had allocated at once."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from services.kvpolicy import compress as core
from services.kvpolicy import snapkv
from services.kvpolicy.manifest import (
    BUDGET_SCOPE_OF,
    AllocationMethod,
    AllocationSpec,
    BudgetSpec,
    GQAOrder,
    GQAReduction,
    KVVisibilityPolicyManifest,
    Pooling,
    TieRule,
    default_manifests,
)
from services.model import PrefillOptions, PrefillResult, prefill
from services.model.config import make_tensor_contract, parse_model_config
from services.model.model import CausalLM

torch.set_num_threads(1)

PROMPT = 120
IDENTITY = core.StateIdentity("req-workspace", 1)
# Scalars the kernels allocate (a dim index, a fill value: a few bytes each) are not terms.
SLACK_BYTES = 64


@functools.cache
def model() -> CausalLM:
    """2 layers, H_q 6 on H_kv 2 (groups of 3), d_h 8, fp32."""
    config = parse_model_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 61,
            "hidden_size": 48,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "torch_dtype": "float32",
        }
    )
    torch.manual_seed(5)
    return CausalLM(config).eval().requires_grad_(False)


@functools.cache
def base_manifests(window: int) -> dict[str, KVVisibilityPolicyManifest]:
    contract = make_tensor_contract(model().config, torch.float32)
    return default_manifests(
        contract, budget_fraction=0.3, observation_window=window, recent_window=40, sinks=2
    )


def snapkv_variant(window: int, **changes: Any) -> KVVisibilityPolicyManifest:
    """The default `snapkv` manifest with SnapKV parameters, allocation, tie rule or sinks
    replaced."""
    manifest = base_manifests(window)["snapkv"]
    selection = manifest.selection
    assert selection.snapkv is not None
    params = {k: changes.pop(k) for k in list(changes) if hasattr(selection.snapkv, k)}
    allocation = changes.pop("allocation", selection.allocation)
    sinks = changes.pop("sinks", selection.protected.sinks)
    selection = replace(
        selection,
        snapkv=replace(selection.snapkv, **params),
        allocation=allocation,
        budget=BudgetSpec(scope=BUDGET_SCOPE_OF[allocation.method], fraction=0.3),
        protected=replace(selection.protected, sinks=sinks),
        **changes,
    )
    return replace(manifest, selection=selection)


CASES: dict[str, Callable[[], KVVisibilityPolicyManifest]] = {
    "snapkv": lambda: base_manifests(8)["snapkv"],
    "pyramid": lambda: base_manifests(8)["snapkv-pyramid"],
    "adakv": lambda: base_manifests(8)["snapkv-adakv"],
    "window": lambda: base_manifests(8)["window"],
    # most candidates kept: the selection's masks and kept indices outweigh its scratch copy
    "snapkv-90pct": lambda: default_manifests(
        make_tensor_contract(model().config, torch.float32), budget_fraction=0.9,
        observation_window=8, recent_window=40, sinks=2,
    )["snapkv"],
    "full": lambda: base_manifests(8)["full"],
    # W = 1: the vote, pooling and GQA-reduction steps outweigh the input check
    "avg-pooling": lambda: snapkv_variant(1),
    "max-pooling-max-reduction": lambda: snapkv_variant(
        1, pooling=Pooling.MAX, gqa_reduction=GQAReduction.MAX
    ),
    "no-pooling-window": lambda: snapkv_variant(
        1, pooling=Pooling.NONE, pooling_kernel=1
    ),
    "reduce-then-max-pool": lambda: snapkv_variant(
        1, pooling=Pooling.MAX, gqa_order=GQAOrder.REDUCE_THEN_POOL
    ),
    "max-reduce-then-avg-pool": lambda: snapkv_variant(
        1, gqa_reduction=GQAReduction.MAX, gqa_order=GQAOrder.REDUCE_THEN_POOL
    ),
    "expand-adakv": lambda: snapkv_variant(
        8, gqa_reduction=GQAReduction.EXPAND,
        allocation=AllocationSpec(AllocationMethod.ADAKV, uniform_share=0.3),
    ),
    "zigzag-sinks": lambda: snapkv_variant(
        2, allocation=AllocationSpec(AllocationMethod.ZIGZAGKV, b_min=2, coverage=0.9), sinks=3
    ),
    "descending-ties": lambda: snapkv_variant(
        4, pooling_kernel=3, tie_rule=TieRule.POSITION_DESCENDING, sinks=2
    ),
}


@functools.cache
def forward(window: int) -> PrefillResult:
    ids = torch.randint(0, 61, (PROMPT,), generator=torch.Generator().manual_seed(9)).tolist()
    options = PrefillOptions(chunk_size=32, obs_window=window, keep_observation=False)
    return prefill(model(), ids, options)  # what the prefill worker holds: the vote alone


def allocated_peak(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """`fn(*args)` and the most bytes it had allocated at once (the CPU allocator's events,
    in time order, as torch's profiler records them)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return result, peak


def stages(manifest: KVVisibilityPolicyManifest) -> dict[str, Any]:
    """Run score → allocate → select → pack one stage at a time, each under accounting."""
    result = forward(core.observation_window(manifest))
    scores, score_peak = allocated_peak(core.score, manifest, result)
    budgets, allocate_peak = allocated_peak(core.allocate, manifest, PROMPT, scores)
    selection, select_peak = allocated_peak(core.select, manifest, PROMPT, scores, budgets)
    compressed, pack_peak = allocated_peak(core.pack, manifest, result, selection, IDENTITY)
    return {
        "result": result, "scores": scores, "compressed": compressed, "score": score_peak,
        "allocate": allocate_peak, "select": select_peak, "pack": pack_peak,
    }


def near(measured: int, formula: int) -> bool:
    return abs(measured - formula) <= SLACK_BYTES


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_terms_are_the_bytes_of_the_actual_tensors(name: str) -> None:
    manifest = CASES[name]()
    run = stages(manifest)
    ledger, result, scores = run["compressed"].ledger, run["result"], run["scores"]
    view = run["compressed"].view
    voted = result.observation_vote
    held = 0 if voted is None else voted.vote.nbytes + voted.minimum.nbytes + voted.maximum.nbytes
    assert result.observation is None  # the window's rows are not kept, their vote is
    assert ledger.observation_bytes == held
    assert ledger.score_bytes == (0 if scores is None else scores.nbytes)
    assert ledger.source_payload_bytes == result.source_k.nbytes + result.source_v.nbytes
    assert ledger.visible_payload_bytes == view.payload_bytes
    if scores is not None:
        assert ledger.score_workspace_bytes >= pooling_buffers(manifest, result)


def pooling_buffers(manifest: KVVisibilityPolicyManifest, result: PrefillResult) -> int:
    """The pooling step's buffers, rebuilt from the runtime's vote: the pooled output, max's
    padded input, and its input when pooling made it (the owner votes under
    reduce_then_pool); of one layer when the scores are made one layer at a time."""
    params = manifest.selection.snapkv
    assert params is not None and result.observation_vote is not None
    vote = result.observation_vote.vote  # [L, H_q, T_p], the input
    pooled_input, made = vote, 0
    if params.gqa_reduction is not GQAReduction.EXPAND and vote.shape[0] > 1:
        pooled_input = vote[:1]  # pool_then_reduce pools (and reduces) one layer at a time
    if params.gqa_order is GQAOrder.REDUCE_THEN_POOL:
        head_map = manifest.tensor.resolved_q_to_kv_head_map()
        pooled_input = snapkv.reduce_gqa(vote, head_map, params.gqa_reduction)  # [L, H_o, T_p]
        made = pooled_input.nbytes if pooled_input is not vote else 0
    pooled = snapkv.pool_scores(pooled_input, params.pooling, params.pooling_kernel)
    if pooled is pooled_input:
        return 0
    pad = params.pooling_kernel // 2
    padded = F.pad(pooled_input, (pad, pad)) if params.pooling is Pooling.MAX else None
    return made + (0 if padded is None else padded.nbytes) + pooled.nbytes


@pytest.mark.parametrize("name", sorted(CASES))
def test_workspace_terms_are_what_each_stage_allocates(name: str) -> None:
    run = stages(CASES[name]())
    ledger, view = run["compressed"].ledger, run["compressed"].view
    assert near(run["score"], ledger.score_workspace_bytes)
    assert near(run["allocate"], ledger.allocator_workspace_bytes)
    assert near(run["select"], ledger.selection_workspace_bytes)
    finished = view.payload_bytes + view.metadata_bytes
    assert near(run["pack"] - finished, ledger.compaction_workspace_bytes)


@pytest.mark.parametrize("name", ["snapkv", "adakv", "avg-pooling", "full", "zigzag-sinks"])
def test_transaction_peak_is_the_measured_peak_of_compress(name: str) -> None:
    manifest = CASES[name]()
    result = forward(core.observation_window(manifest))
    voted = result.observation_vote
    evidence = 0 if voted is None else voted.vote.nbytes + 2 * voted.minimum.nbytes
    held = result.source_k.nbytes + result.source_v.nbytes + evidence
    compressed, peak = allocated_peak(core.compress, manifest, result, IDENTITY)
    ledger = compressed.ledger
    assert near(held + peak, ledger.transaction_peak_bytes)
    assert ledger.transaction_peak_bytes == max(ledger.transaction_phases.values())
    if ledger.observation_bytes:
        assert ledger.transaction_peak_bytes > ledger.full_payload_bytes + ledger.traffic_bytes
