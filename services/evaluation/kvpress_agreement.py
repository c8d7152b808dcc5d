"""Prompt rows kvrelay's SnapKV keeps vs NVIDIA kvpress's `SnapKVPress`, same model and prompt.

kvpress side: the checkpoint runs in `transformers` under `with press(model)`; the press prunes
each layer's cache after the layer's forward. Kept positions are read off the compressed cache
by matching every kept key row to the uncompressed keys of the same forward (exact equality:
gather copies rows), so nothing of kvpress's internals is re-implemented here.
kvrelay side: `generation.compress_prompt`, the prefill worker's stages, on kvrelay's own runtime.
Overlap per (layer, K/V head) is |A ∩ B| / |B| (A kvrelay's rows, B kvpress's rows).

Cases (compression ratio r, prompt of T tokens):
  exact rule  a manifest stating kvpress's rule: observation window = kvpress `window_size`,
              mean vote, avg pooling kernel `kernel_size`, GQA mean, uniform budgets and
              `rows_per_owner` = max(1, floor(T (1 - r))) rows including the window. 100%.
  default/16  kvrelay's default `snapkv` manifest (window 16, fraction 1 - r) vs
              SnapKVPress(window_size=16): kvrelay keeps ceil(T (1 - r)) rows, kvpress
              floor(...): a superset, so 100% of kvpress's rows.
  default/64  the same manifest vs SnapKVPress with its default window of 64: different
              evidence and a different protected suffix, so the overlap drops.

kvpress (0.5.5, needs transformers < 5.3) is imported lazily; `MissingDependency` names it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from services.demo import needle
from services.evaluation.generation import compress_prompt
from services.evaluation.needs import require
from services.evaluation.policies import tensor_with_map
from services.kvpolicy.manifest import (
    AllocationMethod,
    AllocationSpec,
    BudgetScope,
    BudgetSpec,
    KVVisibilityPolicyManifest,
    SnapKVParams,
    TensorContract,
    default_manifests,
)
from services.kvpolicy.state import PositionGrid
from services.model import LoadedModel, load

KVPRESS_PACKAGE = "kvpress"
KVPRESS_DEFAULT_WINDOW = 64  # SnapKVPress.window_size default in kvpress 0.5.5
KVPRESS_KERNEL = 5  # SnapKVPress.kernel_size default
COMPRESSION_RATIO = 0.75  # kvpress removes 75%: kvrelay budget fraction 0.25
AGREEMENT_SEED = 8_100_000


def import_kvpress() -> ModuleType:
    """`kvpress`, or MissingDependency naming the package."""
    return require(KVPRESS_PACKAGE, "kvpress==0.5.5, which needs transformers<5.3")


@dataclass(frozen=True)
class Agreement:
    """Overlap of one case on one prompt."""

    case: str
    context_tokens: int
    compression_ratio: float
    kvpress_window: int
    manifest: KVVisibilityPolicyManifest
    overlap: torch.Tensor  # [L, H_kv] |A ∩ B| / |B|
    kvrelay_rows: torch.Tensor  # [L, H_kv] |A|
    kvpress_rows: torch.Tensor  # [L, H_kv] |B|


def kvpress_rule_manifest(
    tensor: TensorContract, prompt_len: int, compression_ratio: float, window: int,
    kernel: int = KVPRESS_KERNEL,
) -> KVVisibilityPolicyManifest:
    """A kvrelay manifest stating SnapKVPress's rule for prompts of `prompt_len` tokens."""
    base = default_manifests(tensor_with_map(tensor), observation_window=window)["snapkv"]
    kept = max(1, int(prompt_len * (1 - compression_ratio)))
    selection = base.selection
    exact = replace(
        selection,
        budget=BudgetSpec(scope=BudgetScope.OWNER, rows_per_owner=kept),
        # kvpress averages the window's votes; a sum ranks every row identically (one 1/W
        # scale), and only the sum is a manifest's (`SnapKVParams.aggregation`).
        snapkv=SnapKVParams(observation_window=window, pooling_kernel=kernel),
        allocation=AllocationSpec(AllocationMethod.UNIFORM),
    )
    return replace(base, name="kvpress-snapkv-rule", policy_manifest_id="kvpress-snapkv-rule@1",
                   selection=exact)


def kvpress_positions(model: Any, prompt_ids: Sequence[int], press: Any) -> PositionGrid:
    """Positions `[L][H_kv]` that `press` keeps, read off the compressed cache."""
    transformers = importlib.import_module("transformers")
    ids = torch.tensor([list(prompt_ids)])  # [1, T]
    with torch.no_grad():
        full = model(ids, past_key_values=transformers.DynamicCache(), use_cache=True)
        with press(model):
            pressed = model(ids, past_key_values=transformers.DynamicCache(), use_cache=True)
    grid = []
    for layer in range(model.config.num_hidden_layers):
        reference = _layer_keys(full.past_key_values, layer)[0]  # [H_kv, T, d_h]
        kept = _layer_keys(pressed.past_key_values, layer)[0]  # [H_kv, n_kept, d_h]
        grid.append(tuple(_match_rows(reference[h], kept[h]) for h in range(kept.shape[0])))
    return PositionGrid.of(grid)


def overlap(kvrelay: PositionGrid, kvpress: PositionGrid) -> torch.Tensor:
    """|A ∩ B| / |B| per (layer, head) `[L, H]`."""
    return torch.tensor([
        [len(set(a) & set(b)) / len(b) for a, b in zip(layer_a, layer_b, strict=True)]
        for layer_a, layer_b in zip(kvrelay, kvpress, strict=True)
    ])


def agreement(
    loaded: LoadedModel,
    model: Any,
    prompt_ids: Sequence[int],
    case: str,
    manifest: KVVisibilityPolicyManifest,
    press: Any,
    window: int,
    compression_ratio: float,
) -> Agreement:
    """One case on one prompt: kvrelay's selection under `manifest` vs `press`'s kept rows."""
    ours = compress_prompt(loaded, manifest, prompt_ids).selection.positions
    theirs = kvpress_positions(model, prompt_ids, press)
    return Agreement(case, len(prompt_ids), compression_ratio, window, manifest,
                     overlap(ours, theirs), _sizes(ours), _sizes(theirs))


def measure_agreement(
    checkpoint: Path,
    context_lengths: Sequence[int],
    compression_ratio: float = COMPRESSION_RATIO,
) -> list[Agreement]:
    """The three cases on one needle prompt per context length (fp32, CPU)."""
    kvpress = import_kvpress()
    transformers = importlib.import_module("transformers")
    transformers.utils.logging.disable_progress_bar()
    loaded = load(checkpoint, "cpu", "float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.eval()
    tokenizer = loaded.require_tokenizer()
    results = []
    for length in context_lengths:
        seed = AGREEMENT_SEED + length
        prompt = needle.build_prompt(length, 0.5, needle.Placement.END, seed=seed)
        ids = tokenizer.encode(prompt.text)
        default = default_manifests(
            tensor_with_map(loaded.tensor_contract), budget_fraction=1 - compression_ratio
        )["snapkv"]
        window = default.selection.protected_rows
        cases = (
            ("exact rule", kvpress_rule_manifest(loaded.tensor_contract, len(ids),
                                                 compression_ratio, KVPRESS_DEFAULT_WINDOW),
             KVPRESS_DEFAULT_WINDOW),
            (f"default/{window}", default, window),
            (f"default/{KVPRESS_DEFAULT_WINDOW}", default, KVPRESS_DEFAULT_WINDOW),
        )
        for case, manifest, press_window in cases:
            press = kvpress.SnapKVPress(compression_ratio=compression_ratio,
                                        window_size=press_window, kernel_size=KVPRESS_KERNEL)
            results.append(agreement(loaded, model, ids, case, manifest, press, press_window,
                                     compression_ratio))
    return results


def agreement_markdown(results: Sequence[Agreement]) -> str:
    """The report section: per-case summary, per-(layer, head) overlaps, and the differences."""
    lines = [
        "## Agreement with kvpress `SnapKVPress`\n",
        "Same checkpoint (fp32), same needle prompt (depth 50%, question at the end); kvpress "
        "runs the model in `transformers`, kvrelay in its own runtime. Overlap per (layer, K/V "
        "head) = |kvrelay rows ∩ kvpress rows| / |kvpress rows|.\n",
        "| case | tokens | kvpress window | kvrelay manifest | rows/head kvrelay | rows/head "
        "kvpress | mean overlap | min overlap |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        params = r.manifest.selection.snapkv
        assert params is not None
        lines.append(
            f"| {r.case} | {r.context_tokens} | {r.kvpress_window} | W {params.observation_window}"
            f", {params.aggregation.value} vote, {_budget(r.manifest)} | "
            f"{_span(r.kvrelay_rows)} | {_span(r.kvpress_rows)} | "
            f"{100 * float(r.overlap.mean()):.1f}% | {100 * float(r.overlap.min()):.1f}% |"
        )
    lines += ["", "Per (layer, K/V head) overlap:", ""]
    for r in results:
        cells = "; ".join(
            f"L{layer}: " + " ".join(f"{100 * float(x):.0f}%" for x in row)
            for layer, row in enumerate(r.overlap)
        )
        lines.append(f"- {r.case}, {r.context_tokens} tokens: {cells}")
    return "\n".join(lines) + "\n\n" + DIFFERENCES


def _budget(manifest: KVVisibilityPolicyManifest) -> str:
    budget = manifest.selection.budget
    assert budget is not None  # snapkv manifests carry a budget
    if budget.rows_per_owner is not None:
        return f"{budget.rows_per_owner} rows/owner"
    return f"fraction {budget.fraction:g}"


def _span(rows: torch.Tensor) -> str:
    low, high = int(rows.min()), int(rows.max())
    return str(low) if low == high else f"{low}-{high}"


DIFFERENCES = """### What differs, and why

Read from kvpress 0.5.5 `presses/snapkv_press.py` and `presses/scorer_press.py`.

- **Window.** SnapKVPress scores with the last `window_size` = 64 queries by default; kvrelay's
  default manifests use a 16-query observation window. The window is a manifest field
  (`selection.snapkv.observation_window`), so kvpress's 64 is expressible (case *exact rule*).
  With different windows the two vote with different queries and protect different suffixes
  (64 vs 16 rows of each head's budget), which is the whole gap of case *default/64*.
- **Which rows the budget counts.** kvpress keeps n = max(1, floor(T (1 - r))) rows per head
  (`compute_n_kept`), the window included: it pads the window's scores with the global maximum
  score + 1, so top-k takes the window first. kvrelay's fraction budget keeps ceil(f T) rows
  per owner (at least W + 1), the observation suffix included as protected rows. For a
  fraction f = 1 - r kvrelay keeps at most one row more per head, a superset of kvpress's
  rows when windows match (case *default/16*); `rows_per_owner` = floor(T (1 - r)) states
  kvpress's count exactly (a manifest per prompt length: kvrelay's fraction rounds up).
  kvpress with n <= window keeps an arbitrary part of the window (all tied at the padded
  score) and no prefix row; kvrelay rejects a capacity not above its protected rows
  (`selection.budget.rows_per_owner`): not expressible, by design.
- **Vote and pooling.** kvpress averages the window's softmax rows (mean), then
  `F.avg_pool1d(kernel_size=5, padding=2)` (count_include_pad=True). kvrelay's default vote
  is the sum; sum = W x mean, a positive scale that selects the same rows (the exact-rule
  manifest says `mean` anyway); its avg pooling also counts the zero padding.
- **GQA.** kvpress pools per query head, then averages the scores of each K/V head's query
  group (`view(..., groups, ...).mean(2)`): kvrelay's `gqa_reduction: mean` in the same order.
  kvrelay's `max` and `expand` (per-query-head rows, charged at H_q) have no SnapKVPress
  counterpart.
- **Softmax dtype.** kvpress takes the softmax in float32 and casts the probabilities back to
  the query dtype before voting; kvrelay keeps float32 through the vote. Identical for fp32
  checkpoints (this report); for bf16/fp16 models the cast can reorder near-equal scores at
  the budget boundary.
- **Ties.** kvpress uses `torch.topk` (order of equal scores unspecified); kvrelay sorts stably
  and breaks ties by position (`selection.tie_rule`). Only exact ties can differ.
- **Queries.** kvpress re-projects the window's hidden states (`get_prerope_query_states`)
  and applies RoPE; kvrelay captures the queries its prefill already computed. Same arithmetic.
- **Last tokens.** Both keep the last W prompt rows (kvpress: the padded window; kvrelay: the
  protected observation suffix) and neither scores them; kvpress asserts T > window_size,
  kvrelay treats a prompt shorter than its window as all window (nothing omitted).
- **Budgets across heads.** SnapKVPress gives every layer and head the same count, i.e.
  kvrelay's `uniform` allocation; PyramidKV / Ada-KV / HeadKV / ZigZagKV budgets are other
  presses in kvpress and are not compared here.
"""


def _sizes(grid: PositionGrid) -> torch.Tensor:
    return torch.tensor([[len(head) for head in layer] for layer in grid])  # [L, H]


def _layer_keys(cache: Any, layer: int) -> torch.Tensor:
    """Keys `[B, H_kv, T, d_h]` of one layer of a transformers DynamicCache."""
    return cache.layers[layer].keys


def _match_rows(reference: torch.Tensor, kept: torch.Tensor) -> tuple[int, ...]:
    """Sorted positions of `kept` rows `[n, d_h]` among `reference` rows `[T, d_h]` (exact)."""
    equal = (kept[:, None, :] == reference[None, :, :]).all(dim=-1)  # [n, T]
    if not bool(equal.any(dim=1).all()):
        raise RuntimeError("a kept key row matches no uncompressed key row")
    return tuple(sorted(int(i) for i in equal.float().argmax(dim=1)))

