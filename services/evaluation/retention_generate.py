"""`kvrelay eval retention --generate-tokens N`: bounded decode memory under decode-time retention
(issue 18), on the runtime's own decode path.

One request generates N greedy tokens after a prompt, exactly as the decode worker runs it: the
prompt is prefilled and compressed under the retention manifest (`services.kvpolicy.compress`),
admitted into a paged `DecodeCache` with the session's row contract, and every step is
`decode_step` then the session's `decide` + `commit` (`decode_worker.retention.RetentionSession`;
the evaluation is tooling inside `services/`, which never imports a service, so the caller hands
the session class in: the CLI passes the decode worker's). After every step the cache itself is
read: the most rows any (layer, owner) holds (checked against the budget at every step) and the
cache ledger's allocated and ledger bytes (kept per step for the plot and the steady-state
extremes; sampled every `sample_every` steps with ms/token for the table).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from services.evaluation.needs import require
from services.kvpolicy.compress import StateIdentity, compress
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.kvpolicy.retention import Retained
from services.kvpolicy.retention_contract import RetentionContract
from services.kvpolicy.retention_manifests import retention_contracts, retention_manifests
from services.kvpolicy.state import KVPolicyState
from services.model import DecodeCache, PrefillOptions, decode_step, prefill
from services.model.loader import LoadedModel
from services.model.row_attention import RowContract

REQUEST = "eval-generate"
GENERATE_METHODS = tuple(retention_contracts(8, 2))  # the named policies (budget-independent)
PNG = "generate-kv-bytes.png"


class Session(Protocol):
    """What the loop drives: `decode_worker.retention.RetentionSession`'s interface."""

    @property
    def row_contract(self) -> RowContract: ...

    def admitted(self, cache: DecodeCache) -> None: ...

    def decide(self, cache: DecodeCache) -> Retained: ...

    def commit(self, cache: DecodeCache, retained: Retained, last: bool = False) -> object: ...


SessionFactory = Callable[[KVVisibilityPolicyManifest, RetentionContract, KVPolicyState], Session]


@dataclass(frozen=True)
class Sample:
    """The cache after `step` generated tokens; `ms_per_token` over the steps since the last
    sample (decode step + retention decision + commit)."""

    step: int
    resident_max: int
    allocated_bytes: int
    ledger_bytes: int
    ms_per_token: float


@dataclass(frozen=True)
class Generation:
    """One measured generation. Per-step lists are indexed by step - 1."""

    method: str
    budget: int
    prompt_tokens: int
    asked: int
    seconds: float
    samples: tuple[Sample, ...]
    resident: tuple[int, ...] = field(repr=False)  # most rows of any owner after each step
    allocated: tuple[int, ...] = field(repr=False)  # allocated KV bytes after each step

    @property
    def steps(self) -> int:
        return len(self.resident)

    @property
    def over_budget_steps(self) -> int:
        return sum(r > self.budget for r in self.resident)

    @property
    def budget_reached(self) -> int | None:
        """The first step at which some owner holds the budget's rows (None: never)."""
        return next((i + 1 for i, r in enumerate(self.resident) if r >= self.budget), None)

    @property
    def steady_from(self) -> int | None:
        """The step after the budget is first reached: from it on every step evicts, and the
        cache holds the budget's rows plus the room for the next candidate row (None: never)."""
        first = self.budget_reached
        return None if first is None or first >= self.steps else first + 1

    def steady(self) -> tuple[int, int] | None:
        """(min, max) allocated bytes over the steady state (every step from `steady_from`)."""
        first = self.steady_from
        if first is None:
            return None
        tail = self.allocated[first - 1:]
        return min(tail), max(tail)

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.seconds / max(1, self.steps)


def budgeted_manifest(model: LoadedModel, method: str, budget: int,
                      sinks: int) -> KVVisibilityPolicyManifest:
    """The named retention manifest at `budget` rows per owner (as the sweep's cells are)."""
    if method not in GENERATE_METHODS:
        raise ValueError(f"generate_method: unknown {method!r}; known: {', '.join(GENERATE_METHODS)}")
    return retention_manifests(model.tensor_contract, budget_rows=budget, sinks=sinks)[method]


@torch.no_grad()
def generate(model: LoadedModel, manifest: KVVisibilityPolicyManifest, prompt: Sequence[int],
             tokens: int, session_factory: SessionFactory, *, sample_every: int = 256,
             deadline: float | None = None,
             progress: Callable[[int], None] | None = None) -> Generation:
    """Generate `tokens` greedy tokens after `prompt` under `manifest`'s retention, one request
    on the decode path; past `deadline` (`time.monotonic()`) the steps run so far are the
    result."""
    contract = manifest.selection.retention
    if contract is None:
        raise ValueError("generate_method: the manifest declares no selection.retention")
    snapkv = manifest.selection.snapkv
    forward = prefill(model.model, list(prompt),
                      PrefillOptions(obs_window=snapkv.observation_window if snapkv else 0))
    compressed = compress(manifest, forward, StateIdentity(REQUEST, 1))
    session = session_factory(manifest, contract, compressed.state)
    cache = DecodeCache(model.config, model.dtype, model.device,
                        owner_to_kv_head=manifest.expanded_owner_map)
    cache.admit_view(REQUEST, compressed.view, len(prompt), contract=session.row_contract)
    session.admitted(cache)
    token = int(forward.logits.argmax())
    resident: list[int] = []
    allocated: list[int] = []
    samples: list[Sample] = []
    began = last = time.perf_counter()
    for step in range(1, tokens + 1):
        if deadline is not None and time.monotonic() > deadline:
            break
        logits = decode_step(model.model, cache, [token])
        session.commit(cache, session.decide(cache), last=step == tokens)
        token = int(logits[0].argmax())
        ledger = cache.ledger(REQUEST)
        resident.append(int(cache.lengths(REQUEST).max()))
        allocated.append(ledger.allocated_bytes)
        if step % sample_every == 0 or step == tokens:
            now = time.perf_counter()
            since = step - (samples[-1].step if samples else 0)
            samples.append(Sample(step, resident[-1], ledger.allocated_bytes, ledger.ledger_bytes,
                                  1000 * (now - last) / since))
            last = now
        if progress is not None:
            progress(step)
    cache.release(REQUEST)
    return Generation(manifest.name, contract.budget_rows, len(prompt), tokens,
                      time.perf_counter() - began, tuple(samples), tuple(resident),
                      tuple(allocated))


def measure(model: LoadedModel, method: str, budget: int, sinks: int, prompt: Sequence[int],
            tokens: int, session_factory: SessionFactory, sample_every: int,
            max_minutes: float | None) -> Generation:
    """`generate` with a tqdm bar, bounded by `max_minutes`."""
    manifest = budgeted_manifest(model, method, budget, sinks)
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    with tqdm(total=tokens, desc=f"retention generate {method}@{budget}", unit="token") as bar:
        return generate(model, manifest, prompt, tokens, session_factory,
                        sample_every=sample_every, deadline=deadline,
                        progress=lambda _: bar.update(1))


def summary(one: Generation) -> dict[str, Any]:
    """results.json's `generate` entry."""
    steady = one.steady()
    return {"method": one.method, "budget": one.budget, "prompt_tokens": one.prompt_tokens,
            "asked": one.asked, "steps": one.steps, "seconds": one.seconds,
            "ms_per_token": one.ms_per_token, "resident_max": max(one.resident, default=0),
            "over_budget_steps": one.over_budget_steps,
            "bounded_every_step": one.over_budget_steps == 0,
            "budget_reached_at": one.budget_reached, "steady_from": one.steady_from,
            "steady_allocated_min": steady[0] if steady else None,
            "steady_allocated_max": steady[1] if steady else None,
            "steady_ratio": steady[1] / steady[0] if steady else None,
            "samples": [vars(s) for s in one.samples]}


def plot(one: Generation, out: Path) -> str:
    """Allocated KV bytes and resident rows per owner vs step (every step) -> the PNG's name."""
    require("matplotlib").use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, one.steps + 1)
    figure, axis = plt.subplots(figsize=(8, 4.2))
    axis.plot(steps, [b / 2**20 for b in one.allocated], color="tab:blue", linewidth=1.2,
              label="allocated KV bytes")
    axis.set_xlabel("generated tokens")
    axis.set_ylabel("allocated KV (MiB)", color="tab:blue")
    axis.set_ylim(bottom=0)
    rows = axis.twinx()
    rows.plot(steps, one.resident, color="tab:orange", linewidth=1, linestyle="--",
              label="resident rows (max per owner)")
    rows.axhline(one.budget, color="grey", linestyle=":", linewidth=1)
    rows.set_ylabel("resident rows, max per owner", color="tab:orange")
    rows.set_ylim(bottom=0)
    axis.set_title(f"{one.method} at {one.budget} rows per owner: decode KV vs step")
    figure.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(out / PNG, dpi=110)
    plt.close(figure)
    return PNG


def markdown(one: Generation, max_minutes: float | None, command: str, png: str) -> str:
    """The report's generation section."""
    data = summary(one)
    stopped = "" if one.steps >= one.asked else (
        f", stopped by the {max_minutes:g}-minute limit at step {one.steps}")
    lines = [
        f"\n## Generation: {one.steps} of {one.asked} tokens{stopped}"
        f" ({one.seconds / 60:.1f} min, {one.ms_per_token:.1f} ms/token)\n",
        f"One request, `{one.method}` at {one.budget} rows per owner, a {one.prompt_tokens}-token"
        " prompt from the text, greedy tokens, on the decode worker's path: prefill, compression"
        " under the budgeted manifest, a paged `DecodeCache`, then per step `decode_step` and"
        " `RetentionSession.decide` + `commit`. After every step the cache is read: the most"
        " rows any (layer, owner) holds and the ledger's bytes. Command: `" + command + "`.\n",
        f"- resident rows at or under the budget at every step: "
        f"{'yes' if data['bounded_every_step'] else 'NO'} (max {data['resident_max']},"
        f" {data['over_budget_steps']} steps over)",
    ]
    if data["steady_from"] is None:
        lines.append("- the budget was not reached before the last step: no steady state")
    else:
        lines.append(
            f"- steady state (every step from {data['steady_from']}; an owner first held the"
            f" budget after step {data['budget_reached_at']}): allocated bytes"
            f" min {data['steady_allocated_min']}, max {data['steady_allocated_max']},"
            f" max/min {data['steady_ratio']:.4f}")
    lines += ["", "| step | resident rows (max per owner) | allocated bytes | ledger bytes |"
              " ms/token |", "|---|---|---|---|---|"]
    for s in _every(one.samples, max(1, one.asked // 8)):
        lines.append(f"| {s.step} | {s.resident_max} | {s.allocated_bytes} | {s.ledger_bytes} |"
                     f" {s.ms_per_token:.1f} |")
    lines += ["", f"![allocated KV bytes and resident rows vs step]({png})", ""]
    return "\n".join(lines) + "\n"


def _every(samples: Sequence[Sample], every: int) -> list[Sample]:
    """The first sample at or past each multiple of `every` steps, and the last one."""
    shown: list[Sample] = []
    due = every
    for index, one in enumerate(samples):
        if one.step >= due or index == len(samples) - 1:
            shown.append(one)
            due = (one.step // every + 1) * every
    return shown
