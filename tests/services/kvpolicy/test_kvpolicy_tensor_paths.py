"""The tensor paths of selection, packing and the input check (issue 17) against independent
references: a brute-force stable sort in Python, symbolic K/V for every gathered row, and the
receipts the per-position Python code produced before them (their digests recorded here)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import struct
from dataclasses import dataclass

import pytest
import torch

from services.kvpolicy import allocation, snapkv
from services.kvpolicy.compress import StateIdentity, compress
from services.kvpolicy.errors import PackingError, SelectionError
from services.kvpolicy.manifest import DType, TensorContract, TieRule, default_manifests
from services.kvpolicy.packing import pack
from services.kvpolicy.receipt import Receipt
from services.kvpolicy.state import PositionGrid
from services.model import ObservationVote, PrefillOptions, prefill
from services.model.config import parse_model_config
from services.model.model import CausalLM

torch.set_num_threads(1)


def brute_top_k(scores: list[float], k: int, tie_rule: TieRule) -> list[int]:
    """The first k of a stable descending sort, by hand: higher score first, then the
    earlier (ascending rule) or later (descending rule) position."""
    sign = 1 if tie_rule is TieRule.POSITION_ASCENDING else -1
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], sign * i))
    return sorted(order[: max(k, 0)])


def tied_scores(rows: int, n: int, levels: int, seed: int) -> torch.Tensor:
    """Scores `[rows, n]` from `levels` distinct values: many ties at every threshold."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, levels, (rows, n), generator=g).float() / levels


@pytest.mark.parametrize("tie_rule", list(TieRule))
def test_top_k_equals_a_stable_sort_with_ties_and_edge_budgets(tie_rule: TieRule) -> None:
    scores = torch.cat([tied_scores(6, 37, 3, 1), tied_scores(6, 37, 1000, 2)])
    scores[0] = 0.5  # every score tied
    scores[1, ::2] = float("-inf")
    for row, k in itertools.product(scores, (-1, 0, 1, 2, 5, 18, 36, 37, 40)):
        values = row.tolist()
        assert snapkv.top_k_positions(row, k, tie_rule) == brute_top_k(values, k, tie_rule)


def brute_select(
    scores: torch.Tensor, budgets: list[list[int]], window: int, prompt: int, tie_rule: TieRule,
    sinks: int,
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    prefix = prompt - min(window, prompt)
    first = min(sinks, prefix)
    out = []
    for layer, owners in enumerate(budgets):
        row = []
        for owner, budget in enumerate(owners):
            candidates = scores[layer, owner, first:prefix].tolist()
            chosen = [first + i for i in brute_top_k(candidates, budget, tie_rule)]
            row.append(tuple(range(first)) + tuple(chosen) + tuple(range(prefix, prompt)))
        out.append(tuple(row))
    return tuple(out)


@pytest.mark.parametrize("tie_rule", list(TieRule))
@pytest.mark.parametrize("sinks", [0, 3])
def test_selection_equals_brute_force_with_uneven_budgets(tie_rule: TieRule, sinks: int) -> None:
    prompt, window = 61, 5
    scores = tied_scores(3 * 4, prompt - window, 4, 7).view(3, 4, prompt - window)
    candidates = prompt - window - sinks
    budgets = [[0, 1, candidates - 1, candidates], [candidates + 9, 7, 0, 13], [2, 2, 30, 5]]
    got = snapkv.select_snapkv(scores, budgets, window, prompt, tie_rule, sinks)
    assert got == brute_select(scores, budgets, window, prompt, tie_rule, sinks)
    assert [len(o) for o in got[0]] == [
        sinks + window, sinks + 1 + window, prompt - 1, prompt
    ]


def symbolic(layers: int, heads: int, seq: int, dim: int) -> torch.Tensor:
    """K[l, h, t, c] = 1000 l + 100 h + 10 t + c, exact in float64."""
    layer, head, t, c = torch.meshgrid(
        *(torch.arange(n, dtype=torch.float64) for n in (layers, heads, seq, dim)), indexing="ij"
    )
    return 1000 * layer + 100 * head + 10 * t + c


def test_every_gathered_row_is_its_symbolic_row_under_expand_owners() -> None:
    layers, kv_heads, seq, dim, origin = 3, 2, 40, 4, 7
    k = symbolic(layers, kv_heads, seq, dim)
    v = -k - 0.5
    owner_map = [0, 0, 1, 1, 1, 0]  # query-head owners (GQA expand), uneven groups
    g = torch.Generator().manual_seed(3)
    owners = range(len(owner_map))
    counts = [[(layer + o * 7) % (seq + 1) for o in owners] for layer in range(layers)]
    selected = [
        [sorted(origin + p for p in torch.randperm(seq, generator=g)[:n].tolist()) for n in row]
        for row in counts
    ]
    view = pack(k, v, selected, owner_map, origin=origin)
    assert view.selected_positions() == selected
    for layer, owner in itertools.product(range(layers), range(len(owner_map))):
        rows = view.rows(layer, owner)
        for r, position in zip(range(rows.start, rows.stop), selected[layer][owner], strict=True):
            t = position - origin
            want = [1000 * layer + 100 * owner_map[owner] + 10 * t + c for c in range(dim)]
            assert view.packed_k[r].tolist() == want
            assert view.packed_v[r].tolist() == [-x - 0.5 for x in want]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ([3, 2], "strictly ascending"),
        ([1, 1], "strictly ascending"),
        ([-1], "outside"),
        ([40], "outside"),
        ([2**70], "outside"),
        ([True], "not an int"),
        ([1.0], "not an int"),
    ],
)
def test_a_bad_segment_among_good_ones_is_named(bad: list[object], reason: str) -> None:
    k = symbolic(2, 2, 40, 2)
    selected: list[list[object]] = [[[0, 5], [1, 2]], [[3], bad]]
    with pytest.raises(PackingError, match=reason) as failure:
        pack(k, k, selected)  # type: ignore[arg-type]
    assert failure.value.field == "selected[1][1]"


SCORERS = {
    "observation": lambda obs, head_map: snapkv.snapkv_scores(obs, 20, 4, *DEFAULTS, head_map),
    "vote": lambda obs, head_map: snapkv.voted_scores(vote_of(obs, 4), 20, *DEFAULTS, head_map),
}


@pytest.mark.parametrize("evidence", sorted(SCORERS))
def test_the_input_check_names_the_layer_and_lets_finite_overflow_through(evidence: str) -> None:
    """From the observation or from the runtime's vote (its per-layer extremes): the same
    faults refused, naming the same layer."""
    scorer = SCORERS[evidence]
    obs = torch.full((3, 2, 4, 20), 0.05)
    head_map = [0, 1]
    for value, column in itertools.product((float("nan"), -1e-3, float("inf")), (2, 18)):
        broken = obs.clone()
        broken[1, 1, 3, column] = value  # column 18 is in the observation suffix
        with pytest.raises(SelectionError, match="layer 1"):
            scorer(broken, head_map)
    huge = obs.clone()
    huge[2, 0, :, 5] = 3e38  # finite, but its vote overflows to +inf: the scores say so
    scores = scorer(huge, head_map)
    assert bool(torch.isposinf(scores[2, 0]).any())


DEFAULTS = (
    snapkv.Pooling.AVG, 5, snapkv.ScoreAggregation.SUM, snapkv.GQAReduction.MEAN,
)


@dataclass(frozen=True)
class Prefill:
    source_k: torch.Tensor
    source_v: torch.Tensor
    observation: torch.Tensor
    prompt_length: int


def arithmetic_prefill(layers: int, q_heads: int, kv_heads: int, dim: int, prompt: int,
                       window: int) -> Prefill:
    """Deterministic tensors from integer arithmetic alone (no RNG, no transcendental
    functions): the same bytes on every machine, with ties among the votes."""
    idx = torch.arange(layers * q_heads * window * prompt, dtype=torch.int64)
    obs = ((idx * 2654435761) % 1000003 % 997).to(torch.float32) / 997
    obs = obs.view(layers, q_heads, window, prompt)
    kv = torch.arange(layers * kv_heads * prompt * dim, dtype=torch.int64)
    k = ((kv * 40503) % 65521).to(torch.float32).view(layers, kv_heads, prompt, dim) / 4096
    return Prefill(k.half(), (-k).half(), obs, prompt)


# Receipt digests of the default manifests over `arithmetic_prefill(3, 4, 2, 8, 300, 16)`,
# recorded from the per-position Python selection and packing that the tensor paths replaced,
# in the receipt format of then (v2: the positions bound as JSON text; `v2_digest`).
RECEIPTS_BEFORE = {
    "full": "7540da1830dacd1d4ee3cce2874b814097a7a94e5919a2cfd3cb6fdcc81555d9",
    "window": "fdfd6636d34a0b303276176a9ca553e801b8ebba85581c390a6654c0c64e4970",
    "sink-recent": "55360d41beefc4fe10eb84d3a70e257aabaac7dd5964f1783ecf051f5803a714",
    "snapkv": "389a426a28d9a98cbb78f45ef55cd4fb5b33eccd60454c4b5ccfcd1bf9b199ce",
    "snapkv-pyramid": "172e3e0bbdf88b63d29e2235d0de2c6439fbd76ab2c91bef7c13988c4deda843",
    "snapkv-adakv": "6ee89afe93359d6685fba515c9ddd18edc789d0b85b14d38c2e88c973c4991e0",
}


def receipt_digests() -> dict[str, str]:
    tensor = TensorContract(3, 4, 2, 8, DType.FLOAT16, DType.FLOAT16)
    manifests = default_manifests(tensor, recent_window=64)
    prefill = arithmetic_prefill(3, 4, 2, 8, 300, 16)
    identity = StateIdentity("req-tensor-paths", 1)
    return {
        name: v2_digest(compress(m, prefill, identity).receipt)
        for name, m in manifests.items() if name in RECEIPTS_BEFORE
    }


def v2_digest(receipt: Receipt) -> str:
    """A receipt's digest in format v2 (positions as nested JSON lists, domain v2), written out
    here: v3 binds the same body with the positions' bytes hashed instead."""
    body = receipt.body() | {
        "selected_positions": [[list(o) for o in layer] for layer in receipt.selected_positions],
        "protected_positions": list(receipt.protected_positions),
        "owner_budgets": [list(row) for row in receipt.owner_budgets or ()],
        "payload": dataclasses.asdict(receipt.payload) if receipt.payload else None,
    }
    text = json.dumps({"domain": "kvrelay.receipt.v2", **body}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_v3_receipt_binds_the_positions_by_their_bytes() -> None:
    tensor = TensorContract(3, 4, 2, 8, DType.FLOAT16, DType.FLOAT16)
    manifest = default_manifests(tensor)["snapkv"]
    receipt = compress(manifest, arithmetic_prefill(3, 4, 2, 8, 300, 16),
                       StateIdentity("req-v3", 1)).receipt
    grid = receipt.selected_positions
    counts = struct.pack(f"<{grid.counts.numel()}q", *grid.counts.reshape(-1).tolist())
    flat = struct.pack(f"<{grid.total}q", *grid.flat.tolist())
    assert grid.digest() == hashlib.sha256(counts + flat).hexdigest()
    fewer = [[list(owner) for owner in layer] for layer in grid]
    del fewer[1][0][3]  # one position fewer: another grid, another digest
    assert PositionGrid.of(fewer).digest() != grid.digest()
    assert PositionGrid.of(grid.nested()).digest() == grid.digest()


def test_receipts_of_the_default_manifests_are_what_they_were() -> None:
    assert receipt_digests() == RECEIPTS_BEFORE


def test_adakv_raw_counts_equal_a_stable_sort_of_the_position_major_scores() -> None:
    owners, prefix = 3, 29
    for seed, levels in ((1, 2), (2, 5), (3, 10_000)):
        scores = tied_scores(owners, prefix, levels, seed)
        flat = scores.transpose(0, 1).reshape(-1).tolist()  # index = position * owners + owner
        for budget in (-1, 0, 1, 7, 40, owners * prefix - 1, owners * prefix, owners * prefix + 5):
            top = brute_top_k(flat, min(budget, len(flat)), TieRule.POSITION_ASCENDING)
            want = [sum(1 for i in top if i % owners == h) for h in range(owners)]
            assert allocation.adakv_raw_counts(scores, budget) == want


# --- the runtime's vote (the prefill worker keeps no observation rows) ------------------------


def vote_of(obs: torch.Tensor, window: int) -> ObservationVote:
    """What the runtime hands over for an observation `[L, H_q, W, T]`, per layer."""
    prefix = obs.shape[-1] - window
    lows, highs = zip(*(torch.aminmax(layer) for layer in obs), strict=True)
    return ObservationVote(window, snapkv.window_vote(obs, prefix), torch.stack(lows),
                           torch.stack(highs))


def test_scores_from_the_vote_are_the_scores_from_the_observation_bit_for_bit() -> None:
    obs = arithmetic_prefill(3, 4, 2, 8, 300, 16).observation
    head_map = [0, 0, 1, 1]
    for aggregation, order in itertools.product(snapkv.ScoreAggregation, snapkv.GQAOrder):
        args = (snapkv.Pooling.AVG, 5, aggregation, snapkv.GQAReduction.MEAN, head_map, order)
        want = snapkv.snapkv_scores(obs, 300, 16, *args)
        got = snapkv.voted_scores(vote_of(obs, 16), 300, *args)
        assert torch.equal(got, want)


def test_a_vote_of_another_window_is_refused() -> None:
    obs = torch.full((3, 2, 4, 20), 0.05)
    with pytest.raises(SelectionError) as wrong:
        snapkv.voted_scores(vote_of(obs, 4), 20, *DEFAULTS, [0, 1], window=8)
    assert wrong.value.field == "observation_vote.window"


def test_the_runtime_votes_what_the_observation_it_keeps_says() -> None:
    config = parse_model_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 50,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "float32",
    })
    torch.manual_seed(3)
    model = CausalLM(config).eval().requires_grad_(False)
    ids = list(range(1, 41))
    kept = prefill(model, ids, PrefillOptions(chunk_size=16, obs_window=6))
    voted = prefill(model, ids, PrefillOptions(chunk_size=16, obs_window=6, keep_observation=False))
    assert kept.observation is not None and voted.observation is None
    assert kept.observation_vote is not None and voted.observation_vote is not None
    assert torch.equal(kept.observation_vote.vote, snapkv.window_vote(kept.observation, 34))
    assert torch.equal(voted.observation_vote.vote, kept.observation_vote.vote)
    assert torch.equal(voted.observation_vote.minimum, kept.observation.amin(dim=(1, 2, 3)))
    assert torch.equal(voted.observation_vote.maximum, kept.observation.amax(dim=(1, 2, 3)))
