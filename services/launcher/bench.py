"""`kvrelay bench e2e`: the disaggregated stack against the same model in one process.

For each prompt length and policy (`full`, SnapKV at 25% and at 10% of the prompt), a warm-up
request and then `repeats` measured requests go through the gateway of a local stack (policy
service, one prefill worker, one decode worker, each its own process with `threads` torch
threads); the same prompts run in this process with the same thread count and the same
pipeline without disaggregation: prefill -> (score -> allocate -> select -> pack) -> decode
from a DecodeCache. Reported: TTFT (median) and decode tokens/s (median over repeats) on both
sides, retained rows and bytes moved. Prompts are filler text of the needle language so the
model keeps writing (no early end of text); its words are English, so a real model (the
default, SmolLM2) reads them as well.

Transfer throughput: for the retained views of the longest prompt, bytes/s through a gloo
pair group vs a plain loopback TCP copy of the same bytes, measured in the same run
(`services.transfer.bench`).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from services.demo import needle
from services.gateway.client import GatewayClient, generate_request
from services.kvpolicy.compress import StateIdentity, compress, observation_window
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    default_manifests,
)
from services.launcher.stack import Stack, StackConfig
from services.model import (
    DecodeCache,
    LoadedModel,
    PrefillOptions,
    SamplingParams,
    decode_step,
    decode_tokens,
    load,
)
from services.model import prefill as model_prefill
from services.model.config import dtype_name
from services.model.tokenizer import TextTokenizer
from services.policy import PolicyClient, PolicyClientConfig
from services.transfer.bench import TransferBenchConfig, TransferBenchResult, run_transfer_bench


@dataclass(frozen=True)
class E2EBenchConfig:
    """Prompt lengths, SnapKV budget fractions, output tokens, measured repeats, threads."""

    checkpoint: Path
    contexts: tuple[int, ...] = (1024, 4096)
    budgets: tuple[float, ...] = (0.25, 0.10)
    max_tokens: int = 32
    repeats: int = 3
    threads: int = 1
    transfer_repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.contexts or any(c < 64 for c in self.contexts):
            raise ValueError(f"contexts: need lengths >= 64, got {self.contexts}")
        if any(not 0 < b <= 1 for b in self.budgets):
            raise ValueError(f"budgets: fractions must be in (0, 1], got {self.budgets}")
        for name in ("max_tokens", "repeats", "threads", "transfer_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Measurement:
    """Medians over repeats of one (policy, prompt length), through the gateway and locally."""

    policy: str
    context: int
    gateway_ttft_ms: float
    gateway_tokens_per_s: float
    local_ttft_ms: float
    local_tokens_per_s: float
    output_tokens: int
    retained_rows: int
    full_rows: int
    bytes_moved: int
    full_payload_bytes: int


@dataclass(frozen=True)
class TransferMeasurement:
    policy: str
    context: int
    result: TransferBenchResult


def bench_manifests(loaded: LoadedModel, budgets: tuple[float, ...]) -> dict[str, KVVisibilityPolicyManifest]:
    """`full` plus one uniform SnapKV manifest per budget fraction, named `snapkv-<pct>pct`."""
    chosen = {"full": default_manifests(loaded.tensor_contract)["full"]}
    for fraction in budgets:
        name = f"snapkv-{round(fraction * 100)}pct"
        base = default_manifests(loaded.tensor_contract, budget_fraction=fraction)["snapkv"]
        chosen[name] = replace(base, name=name, policy_manifest_id=f"{name}@1")
    return chosen


def filler_prompt(loaded: LoadedModel, tokens: int, seed: int) -> list[int]:
    """The first `tokens` token ids of needle-language filler, which the model continues."""
    return filler_ids(loaded.require_tokenizer(), tokens, seed)


def filler_ids(tokenizer: TextTokenizer, tokens: int, seed: int) -> list[int]:
    """`filler_prompt` with just a tokenizer. The filler's words are English, so any tokenizer
    reads them: one id per word (after <bos>) for the demo checkpoint's, one or more for a BPE
    tokenizer."""
    words = [w for sentence in needle.filler(random.Random(seed), tokens) for w in sentence]
    ids = tokenizer.encode(" ".join(words))
    assert len(ids) >= tokens, (len(ids), tokens)  # at least one id per word
    return ids[:tokens]


def run_local(loaded: LoadedModel, manifest: KVVisibilityPolicyManifest, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(ttft ms, decode tokens/s, output tokens) of one request in this process."""
    started = time.perf_counter()
    result = model_prefill(loaded.model, ids, PrefillOptions(obs_window=observation_window(manifest)))
    length = result.prompt_length
    owner_map = manifest.expanded_owner_map
    cache = DecodeCache(loaded.config, loaded.dtype, loaded.device, batch_capacity=1,
                        row_capacity=length + max_tokens + 1, owner_to_kv_head=owner_map)
    compressed = compress(manifest, result, StateIdentity("local", 1))
    cache.admit_view("local", compressed.view, frontier=length)
    first = decode_tokens(loaded, cache, result.logits[None], 1, SamplingParams())
    ttft = time.perf_counter() - started
    decode_started = time.perf_counter()
    rest = decode_tokens_after(loaded, cache, first[0], max_tokens - 1)
    decode_s = time.perf_counter() - decode_started
    return 1000 * ttft, len(rest) / decode_s if rest else 0.0, 1 + len(rest)


def decode_tokens_after(loaded: LoadedModel, cache: DecodeCache, token: int, max_new_tokens: int) -> list[int]:
    """Decode `max_new_tokens` more tokens after `token` (already sampled), greedy."""
    if max_new_tokens <= 0 or token in loaded.generation_config.eos_token_ids:
        return []
    logits = decode_step(loaded.model, cache, [token])
    return decode_tokens(loaded, cache, logits, max_new_tokens, SamplingParams())


def run_e2e_bench(config: E2EBenchConfig, console: Console | None = None,
                  json_out: Path | None = None) -> tuple[list[Measurement], list[TransferMeasurement]]:
    console = console or Console()
    torch.set_num_threads(config.threads)
    loaded = load(config.checkpoint, "cpu")
    manifests = bench_manifests(loaded, config.budgets)
    stack = Stack(StackConfig.with_free_ports(config.checkpoint, threads=config.threads))
    console.print(f"starting a local stack ({config.threads} torch thread(s) per service; logs in {stack.log_dir})")
    with stack:
        asyncio.run(register_manifests(stack.policy_address, manifests))
        with GatewayClient(stack.gateway_address, timeout_s=600) as client:
            rows = [measure(client, loaded, name, manifest, context, config)
                    for context in config.contexts for name, manifest in manifests.items()]
    transfers = _transfers(loaded, rows, config)
    _report(console, config, loaded, rows, transfers)
    if json_out is not None:
        payload = {"config": {**asdict(config), "checkpoint": str(config.checkpoint)},
                   "rows": [asdict(r) for r in rows],
                   "transfer": [{"policy": t.policy, "context": t.context, "bytes": t.result.bytes_per_transfer,
                                 "gloo_bytes_per_s": t.result.gloo_bytes_per_s,
                                 "tcp_bytes_per_s": t.result.tcp_bytes_per_s} for t in transfers]}
        json_out.write_text(json.dumps(payload, indent=2))
    return rows, transfers


async def register_manifests(policy_address: str, manifests: dict[str, KVVisibilityPolicyManifest]) -> None:
    async with PolicyClient(PolicyClientConfig(policy_address, timeout_s=10.0)) as client:
        for manifest in manifests.values():
            await client.register_manifest(manifest.canonical_json())


def measure(client: GatewayClient, loaded: LoadedModel, name: str, manifest: KVVisibilityPolicyManifest,
            context: int, config: E2EBenchConfig) -> Measurement:
    """One cell: a warm-up and `config.repeats` measured requests, each through the gateway
    and in this process."""
    prompts = [filler_prompt(loaded, context, config.seed + 1000 * context + r) for r in range(config.repeats + 1)]
    remote, local = [], []
    for index, ids in enumerate(prompts):
        request = generate_request(ids, manifest_sha256=manifest.sha256, max_tokens=config.max_tokens,
                                   detokenize=False)
        summary = client.generate(request).summary
        outcome = run_local(loaded, manifest, ids, config.max_tokens)
        if index:  # the first request of each cell warms caches and pair groups
            remote.append(summary)
            local.append(outcome)
    last = remote[-1]
    return Measurement(
        policy=name, context=context,
        gateway_ttft_ms=statistics.median(s.ttft_ms for s in remote),
        gateway_tokens_per_s=statistics.median(1000.0 / s.tpot_ms if s.tpot_ms else 0.0 for s in remote),
        local_ttft_ms=statistics.median(o[0] for o in local),
        local_tokens_per_s=statistics.median(o[1] for o in local),
        output_tokens=last.output_tokens,
        retained_rows=last.retained_rows,
        full_rows=last.retained_rows + last.omitted_rows,
        bytes_moved=last.bytes_moved,
        full_payload_bytes=last.ledger.full_payload_bytes,
    )


def _transfers(loaded: LoadedModel, rows: list[Measurement], config: E2EBenchConfig) -> list[TransferMeasurement]:
    """gloo vs loopback TCP for the views of the longest prompt, one per policy."""
    contract = loaded.tensor_contract
    owners = contract.num_layers * contract.num_kv_heads
    longest = max(config.contexts)
    measured = []
    for row in (r for r in rows if r.context == longest):
        bench = TransferBenchConfig(
            num_layers=contract.num_layers, num_kv_heads=contract.num_kv_heads,
            rows_per_head=max(1, row.retained_rows // owners), head_dim=contract.head_dim,
            dtype=dtype_name(loaded.dtype), repeats=config.transfer_repeats, threads=config.threads,
        )
        measured.append(TransferMeasurement(row.policy, row.context, run_transfer_bench(bench)))
    return measured


def _report(console: Console, config: E2EBenchConfig, loaded: LoadedModel, rows: list[Measurement],
            transfers: list[TransferMeasurement]) -> None:
    c = loaded.config
    console.print(f"checkpoint {config.checkpoint} ({c.num_layers} layers, H_q {c.num_q_heads}, H_kv {c.num_kv_heads},"
                  f" d_h {c.head_dim}, {dtype_name(loaded.dtype)}), {config.max_tokens} output tokens,"
                  f" median of {config.repeats}, {config.threads} thread(s) per process")
    table = Table(title="gateway + workers (gw) vs one process (1p); TTFT in ms")
    for column in ("prompt", "policy", "TTFT gw", "TTFT 1p", "tok/s gw", "tok/s 1p", "MB moved"):
        table.add_column(column, justify="right")
    for r in rows:
        share = f" ({r.bytes_moved / r.full_payload_bytes:.0%})" if r.full_payload_bytes else ""
        table.add_row(str(r.context), r.policy, f"{r.gateway_ttft_ms:.0f}", f"{r.local_ttft_ms:.0f}",
                      f"{r.gateway_tokens_per_s:.0f}", f"{r.local_tokens_per_s:.0f}",
                      f"{r.bytes_moved / 1e6:.2f}{share}")
    console.print(table)
    transfer = Table(title="retained view: gloo pair group vs loopback TCP, same bytes")
    for column in ("prompt", "policy", "MB", "gloo MB/s", "TCP MB/s", "gloo/TCP"):
        transfer.add_column(column, justify="right")
    for t in transfers:
        transfer.add_row(str(t.context), t.policy, f"{t.result.bytes_per_transfer / 1e6:.2f}",
                         f"{t.result.gloo_bytes_per_s / 1e6:.0f}", f"{t.result.tcp_bytes_per_s / 1e6:.0f}",
                         f"{t.result.ratio:.2f}")
    console.print(transfer)
