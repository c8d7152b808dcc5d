"""`kvrelay demo`: the main job in one command.

Start the local stack (policy service with embedded Redis, one prefill worker, one decode
worker, gateway; free loopback ports), ask one needle question of the bundled checkpoint
through the gateway under the `full` policy and under `snapkv`, print both answers and the
ledger (KV bytes of the full cache vs retained, bytes moved), then stop the stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from services.gateway.client import GatewayClient, Generation, generate_request
from services.gateway.console import finish_label
from services.launcher.stack import Stack, StackConfig
from services.model import needle
from services.model.evaluate import answered

DEMO_POLICIES = ("full", "snapkv")


@dataclass(frozen=True)
class StackDemoResult:
    prompt: needle.NeedlePrompt
    answers: dict[str, Generation]

    def correct(self, policy: str) -> bool:
        return answered(self.prompt, self.answers[policy].text)


def demo_prompt(context_tokens: int = 1024, seed: int = 7) -> needle.NeedlePrompt:
    """A held-out style needle question, asked at the end of the prompt."""
    return needle.build_prompt(context_tokens, depth=0.3, placement=needle.Placement.END, seed=seed)


def run_stack_demo(
    checkpoint: Path,
    console: Console | None = None,
    *,
    context_tokens: int = 1024,
    max_tokens: int = 3,
    policies: tuple[str, ...] = DEMO_POLICIES,
) -> StackDemoResult:
    console = console or Console()
    prompt = demo_prompt(context_tokens)
    stack = Stack(StackConfig.with_free_ports(checkpoint))
    console.print(
        f"starting a local stack: policy service + embedded Redis, 1 prefill worker, 1 decode worker,"
        f" gateway (logs in {stack.log_dir})"
    )
    with stack:
        result = ask(stack.gateway_address, prompt, console, max_tokens=max_tokens, policies=policies)
    console.print("stack stopped")
    return result


def ask(
    gateway_address: str,
    prompt: needle.NeedlePrompt,
    console: Console,
    *,
    max_tokens: int = 3,
    policies: tuple[str, ...] = DEMO_POLICIES,
) -> StackDemoResult:
    """Ask `prompt` under each policy through the gateway; print the answers and the ledger."""
    console.print(f"gateway on {gateway_address}; a {len(prompt.words)}-token prompt hides the code of"
                  f" {prompt.name!r} at depth {prompt.depth:.0%} and ends with: {' '.join(prompt.words[-9:])}")
    with GatewayClient(gateway_address) as client:
        answers = {
            policy: client.generate(generate_request(prompt.text, policy=policy, max_tokens=max_tokens))
            for policy in policies
        }
    result = StackDemoResult(prompt, answers)
    console.print(_answers_table(result))
    console.print(_ledger_table(result))
    return result


def _answers_table(result: StackDemoResult) -> Table:
    table = Table(title=f"answers (expected: {result.prompt.answer})")
    for column in ("policy", "answer", "correct", "ttft ms", "tpot ms", "finish"):
        table.add_column(column)
    for policy, generation in result.answers.items():
        summary = generation.summary
        table.add_row(policy, generation.text.strip(), "yes" if result.correct(policy) else "no",
                      f"{summary.ttft_ms:.0f}", f"{summary.tpot_ms:.1f}", finish_label(summary.finish_reason))
    return table


def _ledger_table(result: StackDemoResult) -> Table:
    table = Table(title="byte ledger (KV rows of every layer and K/V head)")
    for column in ("policy", "rows kept", "omitted", "KV full", "KV kept", "moved", "moved/full"):
        table.add_column(column, justify="right")
    for policy, generation in result.answers.items():
        summary, ledger = generation.summary, generation.summary.ledger
        share = summary.bytes_moved / ledger.full_payload_bytes if ledger.full_payload_bytes else 0.0
        table.add_row(policy, f"{summary.retained_rows:,}", f"{summary.omitted_rows:,}",
                      _size(ledger.full_payload_bytes), _size(ledger.visible_payload_bytes),
                      _size(summary.bytes_moved), f"{share:.1%}")
    return table


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
