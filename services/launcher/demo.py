"""`kvrelay demo`: the main job in one command.

Start the local stack on its embedded defaults (policy service with embedded Redis, one
prefill worker, one decode worker, gateway; free loopback ports; the default model,
SmolLM2-135M-Instruct), then ask one real question through the gateway as chat messages: a
passphrase hidden in a few thousand tokens of the Python language reference
(`services.launcher.haystack`), under `full`, `snapkv` (25% of the prompt's rows per
K/V head), `snapkv-recall` (the same selection, omitted rows recallable from the prefill
worker's offload store, pages ranked by their key bound) and `snapkv-recall-codes` (the same,
ranked by 4-bit codes of every omitted key: 1.18x snapkv's TPOT where the bound takes 2.09x
over seven questions of this kind, `kvrelay bench recall`). Print each answer, right or wrong, its TTFT/TPOT, and the
byte ledger (KV bytes of the full cache vs retained vs moved vs recalled, and the row codes' table
the decode host keeps for `snapkv-recall-codes`), then stop the stack.

The question (seed, depth, length) was chosen so that the full cache answers it; the seeds
the recall knobs were tuned on are different ones (see `services.gateway.policies`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from services.gateway.client import GatewayClient, Generation, chat_messages, generate_request
from services.gateway.console import finish_label
from services.launcher.haystack import NEEDLE, HaystackQuestion, build_question
from services.launcher.stack import Stack, StackConfig
from services.model.loader import read_checkpoint
from services.model.tokenizer import TextTokenizer

DEMO_POLICIES = ("full", "snapkv", "snapkv-recall", "snapkv-recall-codes")
DEMO_CONTEXT_TOKENS = 3000
DEMO_DEPTH = 0.4
DEMO_SEED = 7
# The answer is one sentence ("The secret passphrase of the archive is ...", ~17 tokens);
# generation ends earlier, at the chat template's end-of-turn token.
DEMO_MAX_TOKENS = 32
_MAX_THREADS = 4


@dataclass(frozen=True)
class StackDemoResult:
    question: HaystackQuestion
    answers: dict[str, Generation]

    def correct(self, policy: str) -> bool:
        return self.question.correct(self.answers[policy].text)


def demo_question(
    tokenizer: TextTokenizer,
    context_tokens: int = DEMO_CONTEXT_TOKENS,
    depth: float = DEMO_DEPTH,
    seed: int = DEMO_SEED,
) -> HaystackQuestion:
    """The demo's question, its haystack measured with the served checkpoint's tokenizer."""
    return build_question(
        lambda text: len(tokenizer.encode(text, add_special_tokens=False)), context_tokens, depth, seed
    )


def run_stack_demo(
    checkpoint: Path,
    console: Console | None = None,
    *,
    context_tokens: int = DEMO_CONTEXT_TOKENS,
    max_tokens: int = DEMO_MAX_TOKENS,
    policies: tuple[str, ...] = DEMO_POLICIES,
) -> StackDemoResult:
    """Start a stack serving `checkpoint`, ask the demo question under each policy, stop."""
    console = console or Console()
    question = demo_question(read_checkpoint(checkpoint).require_tokenizer(), context_tokens)
    # Half the cores each: the prefill worker of one request runs beside the decode worker of
    # the one before (with more threads than cores both slow down several-fold).
    threads = max(1, min(_MAX_THREADS, (os.cpu_count() or 1) // 2))
    stack = Stack(StackConfig.with_free_ports(checkpoint, threads=threads))
    console.print(
        f"starting a local stack serving {checkpoint.name}: policy service + embedded Redis,"
        f" 1 prefill worker, 1 decode worker, gateway (logs in {stack.log_dir})"
    )
    with stack:
        result = ask(stack.gateway_address, question, console, max_tokens=max_tokens, policies=policies)
    console.print("stack stopped")
    return result


def ask(
    gateway_address: str,
    question: HaystackQuestion,
    console: Console,
    *,
    max_tokens: int = DEMO_MAX_TOKENS,
    policies: tuple[str, ...] = DEMO_POLICIES,
) -> StackDemoResult:
    """Ask `question` under each policy through the gateway; print the answers and the ledger."""
    console.print(
        f"gateway on {gateway_address}. The question hides one sentence, "
        f"{NEEDLE.format(answer=question.answer)!r}, after {question.depth:.0%} of "
        f"{question.paragraphs} paragraphs ({question.context_tokens:,} tokens) of the Python "
        f"language reference, then asks: {question.messages[-1].content.rsplit('Question: ', 1)[-1]}"
    )
    chat = chat_messages((m.role, m.content) for m in question.messages)
    with GatewayClient(gateway_address) as client:
        answers = {
            policy: client.generate(generate_request(chat, policy=policy, max_tokens=max_tokens))
            for policy in policies
        }
    result = StackDemoResult(question, answers)
    console.print(_answers_table(result))
    console.print(_ledger_table(result))
    return result


def _answers_table(result: StackDemoResult) -> Table:
    table = Table(title=f"answers (expected: {result.question.answer})")
    for column in ("policy", "answer", "correct", "ttft ms", "tpot ms", "finish"):
        table.add_column(column)
    for policy, generation in result.answers.items():
        summary = generation.summary
        table.add_row(policy, generation.text.strip(), "yes" if result.correct(policy) else "no",
                      f"{summary.ttft_ms:,.0f}", f"{summary.tpot_ms:.1f}",
                      finish_label(summary.finish_reason))
    return table


def _ledger_table(result: StackDemoResult) -> Table:
    table = Table(title="byte ledger (KV rows of every layer and K/V head)")
    for column in ("policy", "rows kept", "omitted", "recalled", "KV full", "KV kept", "moved",
                   "moved/full", "recalled bytes", "code table"):
        table.add_column(column, justify="right")
    for policy, generation in result.answers.items():
        summary, ledger = generation.summary, generation.summary.ledger
        share = summary.bytes_moved / ledger.full_payload_bytes if ledger.full_payload_bytes else 0.0
        table.add_row(policy, f"{summary.retained_rows:,}", f"{summary.omitted_rows:,}",
                      f"{summary.recalled_rows:,}", _size(ledger.full_payload_bytes),
                      _size(ledger.visible_payload_bytes), _size(summary.bytes_moved),
                      f"{share:.1%}", _size(ledger.recalled_bytes), _size(ledger.code_table_bytes))
    return table


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
