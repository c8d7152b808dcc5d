"""Teacher forcing for the positional retention methods (sliding window, sinks + window) in
prefill-sized chunks, for runs far longer than a token-at-a-time loop affords on a CPU.

A positional method's decisions do not read attention, so the runtime's `step` can be run
over the positions alone first: it gives, for every token t, the candidate rows that token
attends over (the rows retained after t - 1, plus t). The model's own layers then read the
text a chunk of queries at a time, each query masked to exactly its candidate rows, keys
gathered only from the columns the chunk sees. Cache-local positions rescore the rows whose
rank distance to the query differs from their position distance (the sinks), as
`retention_eval.SlotCache` does. Equal to the token loop (tested), at prefill speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from services.evaluation.retention_eval import Cell, CellResult, nll_of
from services.kvpolicy.retention import append, new_state, step
from services.kvpolicy.retention_contract import PositionContract, RetentionContract
from services.model.attention import Attend
from services.model.layers import RotaryEmbedding, rotate
from services.model.loader import LoadedModel


def candidate_rows(contract: RetentionContract, tokens: int) -> tuple[list[torch.Tensor], int]:
    """Per token t, the original positions it attends over (ascending), from the runtime's
    decisions over one owner; and the most rows retained after any step."""
    if contract.method.scores:
        raise ValueError(f"{contract.method.value} reads attention: use the token loop")
    state = new_state(contract, torch.empty((1, 0), dtype=torch.int64),
                      torch.zeros(1, dtype=torch.int64))
    rows, most = [], 0
    for t in range(tokens):
        state = append(contract, state, torch.tensor([t]))
        rows.append(state.positions[0, : int(state.lengths[0])].clone())
        state = step(contract, state, None, t).state
        most = max(most, int(state.lengths[0]))
    return rows, most


def _chunk_layout(rows: list[torch.Tensor], start: int, local: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key columns the chunk's queries see, [n, m] visibility, [n, m] extra rotation."""
    columns = torch.unique(torch.cat(rows))  # sorted original positions
    visible = torch.zeros((len(rows), columns.numel()), dtype=torch.bool)
    shift = torch.zeros((len(rows), columns.numel()), dtype=torch.int64)
    for i, seen in enumerate(rows):
        where = torch.searchsorted(columns, seen)
        visible[i, where] = True
        if local:  # rank distance minus position distance, per visible row
            t = start + i
            rank = torch.arange(seen.numel())
            shift[i, where] = (rank - (seen.numel() - 1)) - (seen - t)
    return columns, visible, shift


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
            shift: torch.Tensor, rotary: RotaryEmbedding, scale: float) -> torch.Tensor:
    """q [n, H_q, d], keys/values [H_kv, m, d], visible/shift [n, m] -> [n, H_q, d]."""
    group = q.shape[1] // keys.shape[0]
    k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H_q, m, d]
    scores = torch.einsum("nhd,hmd->hnm", q, k) * scale
    query, column = shift.nonzero(as_tuple=True)
    if query.numel():
        rotated = rotate(k[:, column].transpose(0, 1), shift[query, column], rotary)  # [M,H_q,d]
        scores[:, query, column] = (q[query] * rotated).sum(-1).T * scale
    probs = torch.softmax(scores.masked_fill(~visible[None], -torch.inf), dim=-1)
    return torch.einsum("hnm,hmd->nhd", probs, v)


@torch.no_grad()
def chunked_teacher_forced(model: LoadedModel, ids: torch.Tensor, cell: Cell, chunk: int = 256,
                           progress: Callable[[int], None] | None = None) -> CellResult:
    """One positional cell over `ids` in chunks of queries: per-token NLL and costs."""
    assert cell.contract is not None
    rows, most = candidate_rows(cell.contract, ids.numel() - 1)
    lm, layers = model.model, model.config.num_layers
    local = cell.contract.positions is PositionContract.CACHE_LOCAL
    keys: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    out: list[torch.Tensor] = []
    began = time.perf_counter()
    for start in range(0, ids.numel() - 1, chunk):
        part = ids[start: min(start + chunk, ids.numel() - 1)]
        columns, visible, shift = _chunk_layout(rows[start: start + part.numel()], start, local)

        def attention(layer: int, columns: torch.Tensor = columns, visible: torch.Tensor = visible,
                      shift: torch.Tensor = shift) -> Attend:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                keys[layer].append(k.float().transpose(0, 1))  # [H_kv, n, d] post-RoPE
                values[layer].append(v.float().transpose(0, 1))
                seen_k = torch.cat(keys[layer], 1)[:, columns]
                seen_v = torch.cat(values[layer], 1)[:, columns]
                return _attend(q.float(), seen_k, seen_v, visible, shift, lm.rotary,
                               lm.scale).to(q.dtype)
            return attend

        logits = lm(part, torch.arange(start, start + part.numel()), attention)
        out.append(nll_of(logits, ids[start + 1: start + part.numel() + 1]))
        if progress is not None:
            progress(part.numel())
    ms = (time.perf_counter() - began) * 1000 / max(1, ids.numel() - 1)
    return CellResult(cell, torch.cat(out).tolist(), most, ms, 0.0)
