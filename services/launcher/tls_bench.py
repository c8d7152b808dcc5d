"""`kvrelay bench tls`: TTFT and TPOT through the gateway, plaintext stack vs mutual-TLS stack.

In one run, `pairs` times: two local stacks (policy service, prefill worker, decode worker,
gateway; each its own process) start one after the other on free ports, one with `--plaintext`
everywhere, one with mutual TLS on every hop (a development CA and per-role certificates written
by `default_bundle` into a temporary directory; the client holds the `client` certificate).
Then both serve the same prompts, one request at a time, each prompt to both stacks in turn
(ABBA order): `warmup` requests (the first on a new stack pays for the new channels and their
handshakes, and for warming caches), then `prompts` measured ones; then both stop. More than one
pair shows how much two stacks of the same transport differ, which on a small model and a
shared host can exceed what TLS costs. Reported per stack and pooled per transport: p50 of TTFT
and TPOT as the client sees them (first token event; mean gap between token events after it)
and as the gateway reports them (its summary), the first warm-up request's TTFT, and
mTLS/plaintext ratios.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.gateway.client import GatewayClient, generate_request
from services.launcher.bench import filler_ids
from services.launcher.stack import Stack, StackConfig
from services.model.loader import read_checkpoint
from services.security.certs import default_bundle

TRANSPORTS = ("plaintext", "mtls")


@dataclass(frozen=True)
class TlsE2EConfig:
    """What each stack serves: `warmup` + `prompts` requests of `context` prompt tokens and
    `max_tokens` output tokens under manifest name `policy`; `threads` per service."""

    checkpoint: Path
    transports: tuple[str, ...] = TRANSPORTS
    prompts: int = 16
    pairs: int = 2
    warmup: int = 1
    context: int = 512
    max_tokens: int = 32
    policy: str = "snapkv"
    threads: int = 1
    seed: int = 0
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        unknown = [t for t in self.transports if t not in TRANSPORTS]
        if not self.transports or unknown or len(set(self.transports)) != len(self.transports):
            raise ValueError(
                f"transports: {self.transports} must be distinct names of {TRANSPORTS}"
            )
        if not 1 <= self.prompts <= 200:
            raise ValueError(f"prompts: {self.prompts} must be in 1..200")
        if not 1 <= self.pairs <= 10:
            raise ValueError(f"pairs: {self.pairs} must be in 1..10")
        if not 1 <= self.warmup <= 20:
            raise ValueError(f"warmup: {self.warmup} must be in 1..20")
        if self.context < 16 or self.max_tokens < 2 or self.threads < 1:
            raise ValueError(
                "context/max_tokens/threads: need context >= 16, max_tokens >= 2 (for a TPOT), "
                "threads >= 1"
            )


@dataclass(frozen=True)
class RequestTiming:
    """One request: as the client saw it, and as the gateway's summary reports it (ms)."""

    client_ttft_ms: float
    client_tpot_ms: float
    gateway_ttft_ms: float
    gateway_tpot_ms: float
    output_tokens: int


@dataclass(frozen=True)
class TransportResult:
    """One stack's requests; `pair` numbers the stack pair (from 1), 0 pools every pair."""

    transport: str
    pair: int
    startup_s: float
    first_ttft_ms: float  # the first warm-up request on the new stack (client side)
    requests: tuple[RequestTiming, ...]  # the measured ones

    def p50(self, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.requests)

    @property
    def label(self) -> str:
        return f"{self.transport} (all)" if self.pair == 0 else f"{self.transport} #{self.pair}"


def pooled(results: Sequence[TransportResult], transport: str) -> TransportResult:
    """Every pair's requests of `transport` as one result (medians of the per-stack values)."""
    mine = [r for r in results if r.transport == transport and r.pair > 0]
    return TransportResult(
        transport,
        0,
        statistics.median(r.startup_s for r in mine),
        statistics.median(r.first_ttft_ms for r in mine),
        tuple(request for r in mine for request in r.requests),
    )


METRICS = ("client_ttft_ms", "client_tpot_ms", "gateway_ttft_ms", "gateway_tpot_ms")


def timed_generate(
    client: GatewayClient, ids: Sequence[int], config: TlsE2EConfig
) -> RequestTiming:
    """One Generate, timing its token events as they arrive."""
    request = generate_request(
        list(ids), policy=config.policy, max_tokens=config.max_tokens, detokenize=False
    )
    arrivals: list[float] = []
    began = time.perf_counter()
    for event in client.stream(request):
        if event.HasField("summary"):
            summary = event.summary
            break
        arrivals.append(time.perf_counter())
    else:
        raise RuntimeError(f"gateway {client.address} ended the stream without a summary")
    if len(arrivals) < 2:
        raise RuntimeError(f"{len(arrivals)} token(s) streamed: no TPOT (the model ended early)")
    return RequestTiming(
        client_ttft_ms=1000 * (arrivals[0] - began),
        client_tpot_ms=1000 * (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1),
        gateway_ttft_ms=summary.ttft_ms,
        gateway_tpot_ms=summary.tpot_ms,
        output_tokens=len(arrivals),
    )


@dataclass(frozen=True)
class Side:
    """One started stack of the run and the client that reaches it."""

    transport: str
    client: GatewayClient
    startup_s: float


def start_side(
    stacks: contextlib.ExitStack, config: TlsE2EConfig, transport: str, tls_dir: Path | None
) -> Side:
    """Start a stack (stopped when `stacks` closes) and open a client to its gateway."""
    stack = Stack(
        StackConfig.with_free_ports(
            config.checkpoint,
            threads=config.threads,
            tls_dir=tls_dir,
            metrics_base_port=0,
            start_timeout_s=config.start_timeout_s,
        )
    )
    began = time.perf_counter()
    stacks.enter_context(stack)
    startup_s = time.perf_counter() - began
    client = stacks.enter_context(
        GatewayClient(
            stack.gateway_address, timeout_s=600, security=stack.client_security("client")
        )
    )
    return Side(transport, client, startup_s)


def run_pair(
    config: TlsE2EConfig, pair: int, certs: Path, prompts: Sequence[Sequence[int]]
) -> list[TransportResult]:
    """Start one stack per transport (the order alternates between pairs), then send each
    prompt to every stack in turn, ABBA, one request at a time; stop them."""
    transports = config.transports if pair % 2 else config.transports[::-1]
    with contextlib.ExitStack() as stacks:
        sides = [start_side(stacks, config, t, certs if t == "mtls" else None) for t in transports]
        timings: dict[str, list[RequestTiming]] = {side.transport: [] for side in sides}
        for index, ids in enumerate(prompts):
            for side in sides if index % 2 == 0 else sides[::-1]:
                timings[side.transport].append(timed_generate(side.client, ids, config))
    return [
        TransportResult(
            side.transport,
            pair,
            side.startup_s,
            timings[side.transport][0].client_ttft_ms,
            tuple(timings[side.transport][config.warmup :]),
        )
        for side in sorted(sides, key=lambda side: config.transports.index(side.transport))
    ]


def run_tls_e2e_bench(config: TlsE2EConfig) -> list[TransportResult]:
    """`config.pairs` stack pairs one after the other, the same prompts each; one certificate
    set for every mTLS stack. Returns each stack's result, then one pooled per transport."""
    tokenizer = read_checkpoint(config.checkpoint).require_tokenizer()
    prompts = [
        filler_ids(tokenizer, config.context, config.seed + r)
        for r in range(config.warmup + config.prompts)
    ]
    with tempfile.TemporaryDirectory(prefix="kvrelay-tls-e2e-") as temp:
        certs = Path(temp) / "certs"
        default_bundle(certs)
        results = [
            r for pair in range(1, config.pairs + 1) for r in run_pair(config, pair, certs, prompts)
        ]
    return results + [pooled(results, t) for t in config.transports]


def report_rows(results: Sequence[TransportResult]) -> list[dict[str, object]]:
    """Per pair: one row per transport (p50s), then mtls/plaintext. Then the pooled rows (pair
    0) and the geometric mean of the pairs' ratios: the two stacks of a pair ran interleaved,
    under the same load; pooled medians mix pairs that ran under different loads."""
    rows: list[dict[str, object]] = []
    pair_ratios: list[dict[str, float]] = []
    for pair in sorted({r.pair for r in results} - {0}):
        group = {r.transport: r for r in results if r.pair == pair}
        rows += [_row(r) for r in group.values()]
        if "plaintext" in group and "mtls" in group:
            pair_ratios.append(ratios(group["mtls"], group["plaintext"]))
            rows.append(_ratio_row(f"mtls/plaintext #{pair}", pair_ratios[-1]))
    rows += [_row(r) for r in results if r.pair == 0]
    if pair_ratios:
        mean = {k: statistics.geometric_mean(r[k] for r in pair_ratios) for k in pair_ratios[0]}
        rows.append(_ratio_row("mtls/plaintext (geomean of pairs)", mean))
    return rows


RATIO_KEYS = (*(f"{name}_p50" for name in METRICS), "first_request_ttft_ms", "stack_start_s")


def ratios(mtls: TransportResult, plain: TransportResult) -> dict[str, float]:
    """mTLS over plaintext for every column of a row (RATIO_KEYS)."""
    values = [mtls.p50(n) / plain.p50(n) for n in METRICS]
    values += [mtls.first_ttft_ms / plain.first_ttft_ms, mtls.startup_s / plain.startup_s]
    return dict(zip(RATIO_KEYS, values, strict=True))


def _row(r: TransportResult) -> dict[str, object]:
    return {
        "stack": r.label,
        "requests": len(r.requests),
        **{f"{name}_p50": round(r.p50(name), 2) for name in METRICS},
        "first_request_ttft_ms": round(r.first_ttft_ms, 1),
        "stack_start_s": round(r.startup_s, 1),
    }


def _ratio_row(label: str, values: dict[str, float]) -> dict[str, object]:
    return {"stack": label, "requests": "", **{k: round(v, 3) for k, v in values.items()}}


def render_markdown(
    config: TlsE2EConfig, results: Sequence[TransportResult], command: str, host: str
) -> str:
    rows = report_rows(results)
    columns = list(rows[0])
    table = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    table += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(
        [
            "# Through the gateway: mutual TLS vs plaintext",
            "",
            f"`{command}` ({host}). Checkpoint `{config.checkpoint.name}`, policy "
            f"`{config.policy}`, {config.context}-token prompts, {config.max_tokens} output "
            f"tokens, {config.threads} torch thread(s) per service; per stack {config.warmup} "
            f"warm-up request(s), then {config.prompts} measured ones, one at a time, each prompt "
            f"to both stacks in turn (ABBA order); {config.pairs} stack pair(s), one after the "
            "other, then pooled (all); the summary ratio is the geometric mean of the pairs' "
            "ratios (each pair ran interleaved, under one load); client = as the client sees it, "
            "gateway = the gateway's summary. TTFT includes every internal hop (gateway -> "
            "prefill -> policy, prefill -> decode handoff, decode -> gateway stream), each mTLS "
            "on the TLS stack.",
            "",
            *table,
            "",
        ]
    )


def write_plot(results: Sequence[TransportResult], path: Path) -> Path:
    """p50 TTFT and TPOT per transport (pooled over pairs), client and gateway side (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r.pair == 0] or list(results)
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(results)
    for panel, kind in zip(axes, ("ttft", "tpot"), strict=True):
        names = [f"{side}_{kind}_ms" for side in ("client", "gateway")]
        for index, result in enumerate(results):
            panel.bar(
                [i + index * width for i in range(len(names))],
                [result.p50(n) for n in names],
                width,
                label=result.transport,
            )
        panel.set_xticks(
            [i + width * (len(results) - 1) / 2 for i in range(len(names))], ["client", "gateway"]
        )
        panel.set(ylabel=f"p50 {kind.upper()} (ms)")
        panel.legend()
    figure.suptitle("through the gateway: mutual TLS vs plaintext")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
