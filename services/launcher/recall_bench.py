"""`kvrelay bench recall`: recall as a user meets it, through the served stack.

`kvrelay eval recall --suite ruler` measures recall inside one process; this asks the served
stack (`kvrelay up` on its embedded defaults: policy service and embedded Redis, one prefill
worker, one decode worker, gateway) the question `kvrelay demo` asks, a passphrase hidden in a
few thousand tokens of the Python language reference, for several seeds (each its own
passphrase and haystack), under each policy the gateway registers by default: `full`,
`snapkv` (25% of the rows, irrecoverable), `snapkv-recall` (pages ranked by their key bound),
`snapkv-recall-codes` (ranked by the rows' 4-bit codes, recalled past a floor) and
`snapkv-recall-values` (the same, with the omitted pages' estimated mass and mean values added
to each step's attention). One
request at a time; the policies' order reverses from one seed to the next, so a host that
slows down during the run does not favour one of them.

Reported per policy: answers right, TPOT p50 as the gateway's summary gives it and its ratio
to `snapkv` (the median over the seeds of each question's own ratio: the two ran minutes
apart at most), rows recalled as a share of the omitted rows, recall bytes, bytes moved to
the decode worker against the full cache, and the decode host's row-code table. The
question's seed 7 is the demo's; `snapkv-recall` was tuned on seeds 101-106 and
`snapkv-recall-codes` and `snapkv-recall-values` on RULER prompts (`services.gateway.policies`):
report other seeds.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from services.gateway.client import GatewayClient, chat_messages, generate_request
from services.launcher.demo import DEMO_CONTEXT_TOKENS, DEMO_DEPTH, DEMO_MAX_TOKENS, demo_question
from services.launcher.stack import Stack, StackConfig
from services.model.loader import read_checkpoint

RECALL_POLICIES = ("full", "snapkv", "snapkv-recall", "snapkv-recall-codes", "snapkv-recall-values")
REPORT_SEEDS = (7, 201, 202, 203, 204, 205, 206)
BASELINE = "snapkv"


@dataclass(frozen=True)
class ServedRecallConfig:
    """`seeds` questions of `context_tokens` tokens, the needle at `depth`, each asked under
    every one of `policies` (`baseline` among them: the TPOT ratios' denominator)."""

    checkpoint: Path
    seeds: tuple[int, ...] = REPORT_SEEDS
    policies: tuple[str, ...] = RECALL_POLICIES
    baseline: str = BASELINE
    context_tokens: int = DEMO_CONTEXT_TOKENS
    depth: float = DEMO_DEPTH
    max_tokens: int = DEMO_MAX_TOKENS
    threads: int = max(1, min(4, (os.cpu_count() or 1) // 2))
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: {self.seeds} must be distinct, at least one")
        if self.baseline not in self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies: {self.policies} must be distinct and include {self.baseline!r}")
        if self.context_tokens < 256 or not 0 < self.depth < 1 or self.max_tokens < 2 or self.threads < 1:
            raise ValueError("need context_tokens >= 256, 0 < depth < 1, max_tokens >= 2, threads >= 1")


@dataclass(frozen=True)
class Answer:
    """One question under one policy, as the gateway's summary reports it."""

    seed: int
    policy: str
    correct: bool
    text: str
    ttft_ms: float
    tpot_ms: float
    output_tokens: int
    omitted_rows: int
    recalled_rows: int
    recalled_bytes: int
    bytes_moved: int
    full_payload_bytes: int
    code_table_bytes: int


def run_served_recall(
    config: ServedRecallConfig, progress: Callable[[Answer], None] | None = None
) -> list[Answer]:
    """Start one stack, ask every seed's question under every policy, stop it."""
    tokenizer = read_checkpoint(config.checkpoint).require_tokenizer()
    stack = Stack(StackConfig.with_free_ports(config.checkpoint, threads=config.threads,
                                              start_timeout_s=config.start_timeout_s))
    answers: list[Answer] = []
    with stack, GatewayClient(stack.gateway_address, timeout_s=600) as client:
        for index, seed in enumerate(config.seeds):
            question = demo_question(tokenizer, config.context_tokens, config.depth, seed)
            chat = chat_messages((m.role, m.content) for m in question.messages)
            for policy in config.policies if index % 2 == 0 else config.policies[::-1]:
                generation = client.generate(generate_request(chat, policy=policy, max_tokens=config.max_tokens))
                summary, ledger = generation.summary, generation.summary.ledger
                answers.append(Answer(
                    seed=seed, policy=policy, correct=question.correct(generation.text),
                    text=generation.text.strip(), ttft_ms=summary.ttft_ms, tpot_ms=summary.tpot_ms,
                    output_tokens=summary.output_tokens, omitted_rows=summary.omitted_rows,
                    recalled_rows=summary.recalled_rows, recalled_bytes=ledger.recalled_bytes,
                    bytes_moved=summary.bytes_moved, full_payload_bytes=ledger.full_payload_bytes,
                    code_table_bytes=ledger.code_table_bytes,
                ))
                if progress is not None:
                    progress(answers[-1])
    return answers


@dataclass(frozen=True)
class PolicySummary:
    """One policy over every question."""

    policy: str
    questions: int
    correct: int
    tpot_p50_ms: float
    tpot_ratio: float | None  # median over the questions of tpot / the baseline's tpot
    recalled_share_max: float  # recalled / omitted rows, the largest of the questions
    recalled_kib_p50: float
    moved_share_p50: float  # bytes moved / the full cache's payload bytes
    code_table_mib_p50: float


def summarize(answers: Sequence[Answer], baseline: str = BASELINE) -> list[PolicySummary]:
    """Per policy, in the order the answers first name them."""
    base = {a.seed: a.tpot_ms for a in answers if a.policy == baseline and a.tpot_ms > 0}
    summaries = []
    for policy in dict.fromkeys(a.policy for a in answers):
        mine = [a for a in answers if a.policy == policy]
        ratios = [a.tpot_ms / base[a.seed] for a in mine if a.seed in base and a.tpot_ms > 0]
        summaries.append(PolicySummary(
            policy=policy, questions=len(mine), correct=sum(a.correct for a in mine),
            tpot_p50_ms=statistics.median(a.tpot_ms for a in mine),
            tpot_ratio=statistics.median(ratios) if ratios else None,
            recalled_share_max=max(a.recalled_rows / a.omitted_rows if a.omitted_rows else 0.0 for a in mine),
            recalled_kib_p50=statistics.median(a.recalled_bytes / 1024 for a in mine),
            moved_share_p50=statistics.median(
                a.bytes_moved / a.full_payload_bytes if a.full_payload_bytes else 0.0 for a in mine),
            code_table_mib_p50=statistics.median(a.code_table_bytes / (1 << 20) for a in mine),
        ))
    return summaries


def render_markdown(config: ServedRecallConfig, answers: Sequence[Answer], command: str, host: str) -> str:
    summaries = summarize(answers, config.baseline)
    table = [
        f"| policy | right | TPOT p50 ms | TPOT / {config.baseline} (median) | recalled of omitted (max) "
        "| recall KiB (p50) | moved / full KV (p50) | row-code table MiB (p50) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summaries:
        ratio = f"{s.tpot_ratio:.2f}x" if s.tpot_ratio is not None else "-"
        table.append(
            f"| {s.policy} | {s.correct}/{s.questions} | {s.tpot_p50_ms:.1f} | {ratio} "
            f"| {s.recalled_share_max:.2%} | {s.recalled_kib_p50:,.0f} | {s.moved_share_p50:.1%} "
            f"| {s.code_table_mib_p50:.1f} |"
        )
    detail = ["| seed | policy | right | TPOT ms | tokens | recalled rows | answer |",
              "| ---: | --- | --- | ---: | ---: | ---: | --- |"]
    for a in answers:
        text = a.text.replace("|", "\\|").replace("\n", " ")
        detail.append(f"| {a.seed} | {a.policy} | {'yes' if a.correct else 'no'} | {a.tpot_ms:.1f} "
                      f"| {a.output_tokens} | {a.recalled_rows:,} | {text[:70]} |")
    return "\n".join([
        "# Recall through the served stack",
        "",
        f"`{command}` ({host}). Checkpoint `{config.checkpoint.name}` served by one local stack "
        f"(policy service and embedded Redis, 1 prefill worker, 1 decode worker, gateway; "
        f"{config.threads} torch thread(s) each). The demo's question, a passphrase after "
        f"{config.depth:.0%} of ~{config.context_tokens:,} tokens of the Python language reference, "
        f"at seeds {', '.join(map(str, config.seeds))}; one request at a time, up to "
        f"{config.max_tokens} output tokens, the policies' order reversed every other seed. "
        "TPOT is the gateway's (summary); its ratio is each question's own against "
        f"`{config.baseline}`, the median over the questions. `snapkv-recall` was tuned on seeds "
        "101-106 and `snapkv-recall-codes` and `snapkv-recall-values` on RULER tuning prompts, "
        "neither on these.",
        "",
        *table,
        "",
        "## Every answer",
        "",
        *detail,
        "",
    ])


def write_plot(config: ServedRecallConfig, answers: Sequence[Answer], path: Path) -> Path:
    """Per policy: answers right, and TPOT against the baseline (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = summarize(answers, config.baseline)
    names = [s.policy for s in summaries]
    figure, (right, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    right.bar(names, [s.correct / s.questions for s in summaries])
    right.set(ylabel="answers right", ylim=(0, 1))
    tpot.bar(names, [s.tpot_ratio or 0.0 for s in summaries])
    tpot.axhline(1.3, linestyle="--", color="grey", label="1.3x (issue 19's goal)")
    tpot.set(ylabel=f"TPOT / {config.baseline} (median)")
    tpot.legend()
    for panel in (right, tpot):
        panel.tick_params(axis="x", labelrotation=20)
    figure.suptitle(f"recall through the served stack, {len(config.seeds)} questions")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def answers_json(answers: Sequence[Answer]) -> list[dict[str, object]]:
    return [asdict(a) for a in answers]
