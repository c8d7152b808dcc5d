"""`kvrelay eval retention`: perplexity under decode-time retention, by teacher forcing (issue 18).

Every policy cell reads the same text one token at a time through the checkpoint's own layers,
keeping a small dense cache per (layer, K/V head) that the cell's retention contract bounds
after every step with the runtime's decisions (`services.kvpolicy.retention.step`, the same
code the decode worker runs). Cells of one run share each token's forward as a batch
dimension; the full cache (no eviction) is the model's own causal prefill over the same
tokens, which the token loop reproduces exactly when nothing is evicted (tested).

Rows live in physical slots: a cell's score state carries, next to positions and scores, the
slot of each retained row, gathered with the same indices (`gather_rows`). A step that drops
a row frees its slot for the next token's row, so no K/V row moves; attention runs over the
occupied slots (order does not matter to it) and the probabilities are read back in row order
for the policy.

Cache-local cells (StreamingLLM) attend as if every key were rotated by its rank in the cache
and the query by the newest rank. RoPE scores depend only on the difference, so keys stay
post-RoPE at their original positions, the query at its own, and only the rows whose rank
difference to the query differs from their position difference (for sinks + window: the
sinks) are rotated, by that difference, with `services.model.layers.rotate`: the same scores
as rotating every pre-RoPE key by its slot, at the cost of a few rows.
"""

from __future__ import annotations

import gzip
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.kvpolicy.retention import (
    ScoreState,
    append,
    gather_rows,
    key_positions,
    new_state,
    step,
)
from services.kvpolicy.retention_contract import (
    PositionContract,
    RetentionContract,
    RetentionMethod,
    ScoreOwner,
)
from services.kvpolicy.retention_manifests import retention_contracts
from services.model.attention import Attend, causal_chunk_attention
from services.model.layers import rotate
from services.model.loader import LoadedModel

# The Debian Policy Manual (package `debian-policy`, GPL-2+), about 100K tokens of English
# prose; its first 706 lines are the table of contents.
DEFAULT_TEXT = Path("/usr/share/doc/debian-policy/policy.txt.gz")
DEFAULT_SKIP_LINES = 706
# Named retention policies of `services.kvpolicy.retention_manifests` that the eval sweeps.
METHODS = ("window-decode", "sink-recent-decode", "sink-recent-local", "h2o", "scissorhands",
           "keyformer")
FULL = "full"


@dataclass(frozen=True)
class Cell:
    """One policy at one budget; `contract` None is the full cache."""

    policy: str
    budget: int | None
    contract: RetentionContract | None

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy}@{self.budget}"


@dataclass(frozen=True)
class CellResult:
    """Per-token negative log-likelihood of tokens 1..T-1 and the cell's costs."""

    cell: Cell
    nll: list[float]  # [T - 1], nats, nll[i] predicts token i + 1
    max_rows: int  # the most rows any owner held after a step
    forward_ms_per_token: float  # this cell's share of the batched forward
    policy_ms_per_token: float  # append + step + slot bookkeeping


def cells(methods: Sequence[str], budgets: Sequence[int], sinks: int) -> list[Cell]:
    """The sweep's cells: each named method at each budget."""
    out: list[Cell] = []
    for budget in budgets:
        named = retention_contracts(budget, sinks)
        out.extend(Cell(method, budget, named[method]) for method in methods)
    return out


def read_tokens(model: LoadedModel, text: Path, skip_lines: int, tokens: int) -> torch.Tensor:
    """The first `tokens` tokens of `text` (plain or .gz) after `skip_lines` lines: [T] int64."""
    if text == DEFAULT_TEXT and not text.exists():
        raise FileNotFoundError(f"{text} is missing: `apt-get install debian-policy`, or --text")
    raw = gzip.decompress(text.read_bytes()) if text.suffix == ".gz" else text.read_bytes()
    body = "\n".join(raw.decode("utf-8").splitlines()[skip_lines:])
    ids = model.require_tokenizer().encode(body)[:tokens]
    if len(ids) < tokens:
        raise ValueError(f"{text} holds {len(ids)} tokens after line {skip_lines}, not {tokens}")
    return torch.tensor(ids, dtype=torch.int64)


def nll_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N, V] logits, [N] next tokens -> [N] nats."""
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")


@torch.no_grad()
def full_cache_nll(model: LoadedModel, ids: torch.Tensor, chunk: int = 512) -> list[float]:
    """The full cache: the model's causal prefill over `ids`, in chunks, [T - 1] nats."""
    lm, config = model.model, model.config
    keys: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
    out: list[torch.Tensor] = []
    for start in range(0, ids.numel(), chunk):
        part = ids[start: start + chunk]

        def attention(layer: int, start: int = start) -> Attend:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                keys[layer].append(k.transpose(0, 1).float())  # [H_kv, C, d_h]
                values[layer].append(v.transpose(0, 1).float())
                all_k, all_v = torch.cat(keys[layer], 1), torch.cat(values[layer], 1)
                return causal_chunk_attention(q.float(), all_k, all_v, start, None,
                                              lm.scale).to(q.dtype)
            return attend

        logits = lm(part, torch.arange(start, start + part.numel()), attention)
        targets = ids[start + 1: start + part.numel() + 1]  # the last token predicts nothing
        out.append(nll_of(logits[: targets.numel()], targets))
    return torch.cat(out).tolist()


class SlotCache:
    """The K/V slots of C cells of one budget: [L, C, H_kv, P, d_h] each, P = budget + 1."""

    def __init__(self, model: LoadedModel, group: Sequence[Cell]) -> None:
        config = model.config
        self.cells = list(group)
        self.layers, self.heads = config.num_layers, config.num_kv_heads
        self.group = config.num_q_heads // config.num_kv_heads
        self.slots = max(c.contract.budget_rows for c in group if c.contract) + 1
        shape = (self.layers, len(group), self.heads, self.slots, config.head_dim)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        owners = self.layers * self.heads
        self.local = torch.tensor([_local(c) for c in group])
        self.states = [new_state(_contract(c), torch.empty((owners, 0), dtype=torch.int64),
                                 torch.zeros(owners, dtype=torch.int64)) for c in group]
        self.slot_of = [torch.empty((owners, 0), dtype=torch.int64) for _ in group]
        self.attn = torch.zeros((self.layers, len(group), self.heads, self.slots))
        self.occupied = torch.zeros((len(group), owners, self.slots), dtype=torch.bool)
        self.shift = torch.zeros((len(group), owners, self.slots), dtype=torch.int64)
        self.new_slot = torch.zeros((len(group), owners), dtype=torch.int64)
        self.max_rows = [0] * len(group)

    def append_token(self, t: int) -> None:
        """Step 1 for every cell: a free slot per owner for token t (and, cache-local, each
        row's extra rotation: its rank distance to the query minus its position distance)."""
        for i, cell in enumerate(self.cells):
            state = self.states[i]
            free = (~self.occupied[i]).to(torch.int8).argmax(1)  # [owners] first free slot
            grown = append(_contract(cell), state, torch.full_like(state.lengths, t))
            slot_of = torch.nn.functional.pad(self.slot_of[i], (0, grown.rows - state.rows),
                                              value=-1)
            slot_of.scatter_(1, state.lengths[:, None], free[:, None])
            self.states[i], self.slot_of[i], self.new_slot[i] = grown, slot_of, free
            self.occupied[i].scatter_(1, free[:, None], True)
            if _local(cell):
                rotated = key_positions(_contract(cell), grown)
                query = rotated.gather(1, (grown.lengths - 1)[:, None])
                shift = (rotated - query) - (grown.positions - t)  # slot vs position distance
                self.shift[i] = _scatter_real(slot_of, torch.where(grown.valid(), shift, 0),
                                              self.slots, 0)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [C, H_q, d_h], k/v [C, H_kv, d_h] of this token, rotated at its position: k, v
        stored in each owner's new slot, then attention over the occupied slots."""
        cells, heads = len(self.cells), self.heads
        owners = slice(layer * heads, (layer + 1) * heads)
        slot = self.new_slot[:, owners]  # [C, H_kv]
        index = torch.arange(cells)[:, None], torch.arange(heads)[None, :]
        self.k[layer][index[0], index[1], slot] = k
        self.v[layer][index[0], index[1], slot] = v
        keys = self.k[layer]  # [C, H_kv, P, d_h]
        grouped = q.view(cells, heads, self.group, -1)  # [C, H_kv, g, d_h]
        scores = torch.matmul(grouped, keys.transpose(-1, -2)) * scale  # [C, H_kv, g, P]
        if bool(self.local.any()):
            self._cache_local_scores(scores, grouped, keys, owners, scale)
        mask = self.occupied[:, owners][:, :, None, :]
        probs = torch.softmax(scores.masked_fill(~mask, -torch.inf), dim=-1)
        self.attn[layer] = probs.mean(2)  # kv_head_mean (checked per cell)
        return torch.matmul(probs, self.v[layer]).reshape(cells, heads * self.group, -1)

    def _cache_local_scores(self, scores: torch.Tensor, grouped: torch.Tensor,
                            keys: torch.Tensor, owners: slice, scale: float) -> None:
        """Rescore, in place, the rows whose cache-local rotation differs from their own."""
        shift = self.shift[:, owners]  # [C, H_kv, P]
        cell, head, slot = (shift != 0).nonzero(as_tuple=True)
        if cell.numel() == 0:
            return
        rotated = rotate(keys[cell, head, slot], shift[cell, head, slot], _ROTARY[0])  # [M, d]
        rescored = torch.einsum("mgd,md->mg", grouped[cell, head], rotated) * scale
        scores[cell, head, :, slot] = rescored

    def retain(self, t: int) -> None:
        """Steps 3-7 for every cell: the policy's decision, then slots freed and kept."""
        for i, cell in enumerate(self.cells):
            state, slot_of = self.states[i], self.slot_of[i]
            attn = self.attn[:, i].reshape(-1, self.slots)
            in_rows = torch.gather(attn, 1, slot_of.clamp_min(0)) * state.valid()
            out = step(_contract(cell), state, in_rows, t)
            kept = gather_rows(slot_of, out.keep)
            real = out.state.valid()
            self.slot_of[i] = torch.where(real, kept, -1)
            self.states[i] = out.state
            self.occupied[i] = _scatter_real(self.slot_of[i], real, self.slots, False)
            self.max_rows[i] = max(self.max_rows[i], int(out.state.lengths.max()))


_ROTARY: list = []


def _scatter_real(slot_of: torch.Tensor, values: torch.Tensor, slots: int,
                  fill: bool | int) -> torch.Tensor:
    """[N, P] with values[n, r] at slot slot_of[n, r] for real rows (slot >= 0), `fill`
    elsewhere: padding rows write into a spare column that is cut off."""
    out = torch.full((slot_of.shape[0], slots + 1), fill, dtype=values.dtype)
    out.scatter_(1, torch.where(slot_of >= 0, slot_of, slots), values)
    return out[:, :slots]


def _contract(cell: Cell) -> RetentionContract:
    assert cell.contract is not None
    return cell.contract


def _local(cell: Cell) -> bool:
    return cell.contract is not None and cell.contract.positions is PositionContract.CACHE_LOCAL


def _check_cells(group: Sequence[Cell]) -> None:
    for cell in group:
        contract = _contract(cell)
        if contract.score_owner is not ScoreOwner.KV_HEAD_MEAN:
            raise ValueError(f"{cell.label}: the eval reduces query heads by their mean")


def batched_attention(caches: Sequence[SlotCache], scale: float) -> Callable[[int], Attend]:
    """One forward for every cache's cells (the batch is their concatenation, in order)."""
    bounds = [0]
    for cache in caches:
        bounds.append(bounds[-1] + len(cache.cells))

    def for_layer(layer: int) -> Attend:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            parts = [cache.attend(layer, q[lo:hi].float(), k[lo:hi].float(), v[lo:hi].float(),
                                  scale)
                     for cache, lo, hi in zip(caches, bounds, bounds[1:], strict=False)]
            return torch.cat(parts).to(q.dtype)
        return attend

    return for_layer


@torch.no_grad()
def teacher_forced(model: LoadedModel, ids: torch.Tensor, group: Sequence[Cell],
                   progress: Callable[[int], None] | None = None,
                   deadline: float | None = None) -> list[CellResult]:
    """Every cell of `group` over `ids`, one token at a time, one batched forward per token
    (cells of one budget share a slot cache): per-token NLL and costs. Past `deadline`
    (`time.monotonic()`), the tokens read so far are the result."""
    _check_cells(group)
    lm = model.model
    _ROTARY[:] = [lm.rotary]
    budgets = sorted({_contract(c).budget_rows for c in group})
    caches = [SlotCache(model, [c for c in group if _contract(c).budget_rows == b])
              for b in budgets]
    order = [cell for cache in caches for cell in cache.cells]
    nll = torch.zeros((len(order), ids.numel() - 1))
    forward_s = policy_s = 0.0
    done = 0
    for t in range(ids.numel() - 1):
        if deadline is not None and time.monotonic() > deadline:
            break
        began = time.perf_counter()
        for cache in caches:
            cache.append_token(t)
        appended = time.perf_counter()
        logits = lm(ids[t].expand(len(order)), torch.full((len(order),), t),
                    batched_attention(caches, lm.scale))
        nll[:, t] = nll_of(logits, ids[t + 1].expand(len(order)))
        forwarded = time.perf_counter()
        for cache in caches:
            cache.retain(t)
        forward_s += forwarded - appended
        policy_s += (appended - began) + (time.perf_counter() - forwarded)
        done = t + 1
        if progress is not None:
            progress(t)
    nll = nll[:, :done]
    per_cell = 1000 / (max(1, done) * len(order))
    rows = [n for cache in caches for n in cache.max_rows]
    # Both times are of the whole batch, apportioned evenly: each method's own decision cost
    # comes from `step_costs`, its attention's from `decode_costs`.
    results = {cell.label: CellResult(cell, nll[i].tolist(), rows[i], forward_s * per_cell,
                                      policy_s * per_cell) for i, cell in enumerate(order)}
    return [results[cell.label] for cell in group]


def step_costs(model: LoadedModel, group: Sequence[Cell], steps: int = 50) -> dict[str, float]:
    """ms per token of each cell's retention decision alone (append + step over every
    (layer, owner) at its budget, steady state), with attention from a fixed generator."""
    owners = model.config.num_layers * model.config.num_kv_heads
    costs: dict[str, float] = {}
    generator = torch.Generator().manual_seed(0)
    for cell in group:
        contract = _contract(cell)
        rows = contract.budget_rows
        state: ScoreState = new_state(contract, torch.arange(rows).expand(owners, rows).clone(),
                                      torch.full((owners,), rows))
        weights = torch.rand((owners, rows + 1), generator=generator)
        began = time.perf_counter()
        for t in range(steps):
            state = append(contract, state, torch.full((owners,), rows + t))
            attn = weights[:, : state.rows] / weights[:, : state.rows].sum(1, keepdim=True)
            state = step(contract, state, attn, t).state
        costs[cell.label] = (time.perf_counter() - began) * 1000 / steps
    return costs


def perplexity(nll: Sequence[float], start: int = 0, stop: int | None = None) -> float:
    part = nll[start:stop]
    return math.exp(sum(part) / len(part)) if part else float("nan")


@torch.no_grad()
def decode_cost(model: LoadedModel, budget: int, steps: int = 16) -> float:
    """ms per token of one request's decode step holding `budget` rows per owner and evicting
    nothing (the baseline each method's decision adds to), from random K/V rows."""
    owners = model.config.num_layers * model.config.num_kv_heads
    room = RetentionContract(RetentionMethod.WINDOW, budget + steps + 1, budget + steps + 1)
    cache = SlotCache(model, [Cell("no-eviction", budget, room)])
    positions = torch.arange(budget).expand(owners, budget).clone()
    cache.states[0] = new_state(room, positions, torch.full((owners,), budget))
    cache.slot_of[0] = positions.clone()
    cache.occupied[0, :, :budget] = True
    cache.k.normal_()
    cache.v.normal_()
    lm, token = model.model, torch.zeros(1, dtype=torch.int64)
    elapsed = 0.0
    for t in range(budget, budget + steps):
        cache.append_token(t)
        began = time.perf_counter()
        lm(token, torch.tensor([t]), batched_attention([cache], lm.scale))
        elapsed += time.perf_counter() - began
    return elapsed * 1000 / steps
