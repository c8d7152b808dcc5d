"""Reports of `kvrelay bench policy` (`policy_service.bench`): a console table, JSON, and the
Markdown + PNG summary under docs/results/."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from policy_service.bench import OPERATIONS, BenchRun, Measurement

# The test that shows request generations increasing across key expiry and loss (single and
# cluster), named in the report.
MONOTONICITY_TEST = ("tests/policy_service/test_policy_cluster.py::"
                     "test_request_generation_increases_across_key_expiry_and_loss")
ISSUE_BASELINE_OPS = 1150  # PublishState at 64 clients when issue 21 was filed
SERVICE_PATHS = ("service-framed", "service", "service-unary", "service-unpipelined", "service-no-wait", "store-in-process",
                 "store-in-process-unpipelined")
_SUFFIX = {"service": ", gRPC Session", "service-framed": ", framed sessions (no gRPC)", "service-unary": ", unary calls (no Session)",
           "service-unpipelined": ", unary, unpipelined (before)", "service-no-wait": ", no WAIT"}
_STORE = {"store-in-process": "store in-process (no gRPC)",
          "store-in-process-unpipelined": "store in-process, unpipelined"}


def variant_label(m: Measurement) -> str:
    if m.path in _STORE:
        return _STORE[m.path]
    processes = f"{m.processes} process{'es' if m.processes > 1 else ''}"
    return processes + _SUFFIX.get(m.path, "")


def report_rows(results: Sequence[Measurement]) -> list[dict[str, object]]:
    """One row per service measurement: ours, the direct script at the same backend,
    operation and clients (None for Health and Refused), and the pipe ceiling."""
    by_key = {(m.backend, m.operation, m.path, m.clients): m for m in results}
    rows: list[dict[str, object]] = []
    for m in results:
        if m.path not in SERVICE_PATHS:
            continue
        direct = by_key.get((m.backend, m.operation, "redis-direct", m.clients))
        pipe = by_key.get((m.backend, m.operation, "redis-cli-pipe", 1))
        rows.append({
            "backend": m.backend, "service": variant_label(m), "operation": m.operation, "clients": m.clients,
            "ops_per_s": round(m.ops_per_s), "p50_ms": round(m.p50_ms, 3), "p99_ms": round(m.p99_ms, 3),
            "ceiling_ops_per_s": round(direct.ops_per_s) if direct else None,
            "ceiling_p50_ms": round(direct.p50_ms, 3) if direct else None,
            "ceiling_p99_ms": round(direct.p99_ms, 3) if direct else None,
            "ratio": round(m.ops_per_s / direct.ops_per_s, 3) if direct else None,
            "pipe_ops_per_s": round(pipe.ops_per_s) if pipe else None,
        })
    return rows


def print_report(run: BenchRun, json_path: Path | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = report_rows(run.measurements)
    table = Table(title="policy service on loopback vs the same Lua script straight at Redis")
    for column in ("redis", "service", "op", "clients", "ours ops/s", "p50 ms", "p99 ms", "direct ops/s",
                   "direct p50", "direct p99", "ours/direct", "redis-cli --pipe ops/s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console(width=180).print(table)
    ratios = [float(str(r["ratio"])) for r in rows if r["ratio"] is not None]
    print(f"host: {os.cpu_count()} CPUs; mean ours/direct {statistics.mean(ratios):.3f}")
    if run.failover is not None:
        print(f"failover drill: {run.failover}")
    if json_path is not None:
        failover = asdict(run.failover) if run.failover else None
        json_path.write_text(json.dumps({"rows": rows, "measurements": [asdict(m) for m in run.measurements],
                                         "failover": failover}, indent=2))


def _find(results: Sequence[Measurement], **fields: object) -> Measurement | None:
    for m in results:
        if all(getattr(m, name) == value for name, value in fields.items()):
            return m
    return None


def goal_lines(results: Sequence[Measurement]) -> list[str]:
    """The issue's two efficiency goals, read off this run (one Redis, one process)."""
    lines = []
    one = _find(results, backend="single", path="service", processes=1, operation="PublishState", clients=1)
    direct = _find(results, backend="single", path="redis-direct", operation="PublishState", clients=1)
    floor = _find(results, backend="single", path="service", processes=1, operation="Health", clients=1)
    unary = _find(results, backend="single", path="service-unary", operation="PublishState", clients=1)
    if one and direct:
        floor_text = f"; a bare unary gRPC health check of the same process: p50 {floor.p50_ms:.3f} ms" if floor else ""
        unary_text = f"; unary calls (no Session) {unary.p50_ms:.3f} ms" if unary else ""
        lines.append(f"- One client, PublishState p50: {one.p50_ms:.3f} ms, direct script {direct.p50_ms:.3f} ms "
                     f"(ratio {one.p50_ms / direct.p50_ms:.2f}; goal <= 2){unary_text}{floor_text}.")
    top = max((m.clients for m in results if m.path == "service"), default=0)
    new = _find(results, backend="single", path="service", processes=1, operation="PublishState", clients=top)
    old = _find(results, backend="single", path="service-unpipelined", operation="PublishState", clients=top)
    unary_top = _find(results, backend="single", path="service-unary", operation="PublishState", clients=top)
    if new:
        versus = f", unary and unpipelined (the path before) {old.ops_per_s:.0f} ops/s: " \
                 f"x{new.ops_per_s / old.ops_per_s:.2f}" if old else ""
        if unary_top:
            versus += f", unary calls {unary_top.ops_per_s:.0f} ops/s: x{new.ops_per_s / unary_top.ops_per_s:.2f}"
        lines.append(f"- Saturated ({top} clients), one process, PublishState: {new.ops_per_s:.0f} ops/s{versus}; "
                     f"x{new.ops_per_s / ISSUE_BASELINE_OPS:.2f} the {ISSUE_BASELINE_OPS} ops/s the issue "
                     "measured (goal x2).")
    store = _find(results, backend="single", path="store-in-process", operation="PublishState", clients=top)
    store_before = _find(results, backend="single", path="store-in-process-unpipelined", operation="PublishState",
                         clients=top)
    if store and store_before:
        lines.append(f"- The store alone (this process, no gRPC) at {top} clients: {store.ops_per_s:.0f} ops/s pipelined, "
                     f"{store_before.ops_per_s:.0f} unpipelined (x{store.ops_per_s / store_before.ops_per_s:.2f}).")
    two = _find(results, backend="single", path="service", processes=2, operation="PublishState", clients=top)
    if new and two:
        lines.append(f"- Two processes at {top} clients: {two.ops_per_s:.0f} ops/s (x{two.ops_per_s / new.ops_per_s:.2f} "
                     "one process).")
    return lines + framed_lines(results) + wait_cost_lines(results)


def framed_lines(results: Sequence[Measurement]) -> list[str]:
    """The framed Session listener against the gRPC Session and the direct script (one Redis)."""
    lines = []
    top = max((m.clients for m in results if m.path == "service-framed"), default=0)
    floor = _find(results, backend="single", path="service-framed", processes=1, operation="Refused", clients=1)
    direct = _find(results, backend="single", path="redis-direct", operation="GetFence", clients=1)
    echo = _find(results, backend="single", path="frame-echo", operation="Echo", clients=1)
    if echo and direct:
        lines.append(f"- A bare frame round trip to an echo process (no session, no policy code, no Redis): "
                     f"p50 {echo.p50_ms:.3f} ms, {echo.p50_ms / direct.p50_ms:.2f}x the direct GetFence script: "
                     f"a call through any Python service costs this on top of its Redis call.")
    for operation in OPERATIONS:
        paired = _find(results, backend="single", path="service-framed-paired", operation=operation)
        paired_direct = _find(results, backend="single", path="redis-direct-paired", operation=operation)
        if paired and paired_direct:
            lines.append(f"- **Paired** (one client, framed sessions and the direct script in alternating ABBA "
                         f"rounds, pooled: the ratio the host's drift does not skew), {operation} p50: "
                         f"{paired.p50_ms:.3f} ms vs {paired_direct.p50_ms:.3f} ms direct "
                         f"(ratio {paired.p50_ms / paired_direct.p50_ms:.2f}; goal <= 2); p99 {paired.p99_ms:.3f} "
                         f"vs {paired_direct.p99_ms:.3f} ms.")
    if floor and direct:
        lines.append(f"- Framed sessions, one client, a call refused before Redis (every layer but the store): "
                     f"p50 {floor.p50_ms:.3f} ms, {floor.p50_ms / direct.p50_ms:.2f}x the direct GetFence script "
                     f"({direct.p50_ms:.3f} ms).")
    for operation in OPERATIONS:
        framed = _find(results, backend="single", path="service-framed", processes=1, operation=operation, clients=1)
        grpc = _find(results, backend="single", path="service", processes=1, operation=operation, clients=1)
        direct = _find(results, backend="single", path="redis-direct", operation=operation, clients=1)
        if framed and direct:
            versus = f", gRPC Session {grpc.p50_ms:.3f} ms" if grpc else ""
            lines.append(f"- Framed sessions, one client, {operation} p50: {framed.p50_ms:.3f} ms, direct script "
                         f"{direct.p50_ms:.3f} ms (ratio {framed.p50_ms / direct.p50_ms:.2f}; goal <= 2){versus}.")
        saturated = _find(results, backend="single", path="service-framed", processes=1, operation=operation,
                          clients=top)
        grpc_top = _find(results, backend="single", path="service", processes=1, operation=operation, clients=top)
        if saturated and grpc_top:
            lines.append(f"- Framed sessions, {top} clients, one process, {operation}: {saturated.ops_per_s:.0f} ops/s, "
                         f"gRPC Session {grpc_top.ops_per_s:.0f} (x{saturated.ops_per_s / grpc_top.ops_per_s:.2f}).")
    return lines


def wait_cost_lines(results: Sequence[Measurement]) -> list[str]:
    """What WAIT for one replica costs PublishState on the cluster, per client count."""
    lines = []
    for clients in sorted({m.clients for m in results if m.path == "service-no-wait"}):
        waited = _find(results, backend="cluster", path="service", processes=1, operation="PublishState", clients=clients)
        bare = _find(results, backend="cluster", path="service-no-wait", operation="PublishState", clients=clients)
        if waited and bare:
            lines.append(f"- WAIT 1 on the cluster, PublishState at {clients} clients: p50 {waited.p50_ms:.3f} ms vs "
                         f"{bare.p50_ms:.3f} ms without, {waited.ops_per_s:.0f} vs {bare.ops_per_s:.0f} ops/s.")
    return lines


def render_markdown(run: BenchRun, command: str, host: str) -> str:
    """The run as Markdown: one row per (backend, service variant, operation, clients), the
    goals, the failover drill's count and the monotonicity test."""
    lines = [
        "# Policy service at scale: one Redis vs Redis Cluster, one vs two service processes", "",
        f"Command: `{command}` (one run). Host: {host}. Cluster: three masters with a replica",
        "each, all on this host (`services.redis_cluster`). `direct`: the same Lua script called",
        "straight from Python (redis-py) at the same concurrency; `Health`: a gRPC health check of",
        "the same service process (no policy code, no Redis): the floor of a call to it;",
        "`Refused`: a GetFence the service refuses before Redis (an impossible request id), through",
        "the same client on a framed session: the floor of a framed call; `Echo`: a frame's round",
        "trip to a bare echo process (`policy_service.frame_echo`), the floor of any framed call.", "",
        "| redis | service | op | clients | ops/s | p50 ms | p99 ms | direct ops/s | direct p50 ms"
        " | direct p99 ms | ours/direct | redis-cli --pipe ops/s |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in report_rows(run.measurements):
        cells = [r[k] for k in ("backend", "service", "operation", "clients", "ops_per_s", "p50_ms", "p99_ms",
                                "ceiling_ops_per_s", "ceiling_p50_ms", "ceiling_p99_ms", "ratio", "pipe_ops_per_s")]
        lines.append("| " + " | ".join("–" if c is None else str(c) for c in cells) + " |")
    lines += ["", "## Goals (this run)", "", *goal_lines(run.measurements)]
    if run.failover is not None:
        f = run.failover
        lines += ["", "## Failover drill (`policy_service.failover`)", "",
                  f"{f.requests} requests publishing through the service on a cluster of their own; the master "
                  f"of their slots SIGKILLed after {f.acknowledged} acknowledged states; a replica promoted "
                  f"{f.failover_s:.1f} s later. **Acknowledged states read back from the promoted replica: "
                  f"{f.read_back} of {f.acknowledged}** (missing {f.missing}, half-written {f.torn}); "
                  f"acknowledged while the promoted master had no replica: {f.acknowledged_while_unreplicated}; "
                  f"after the killed node rejoined as its replica: {f.resumed} more; UNAVAILABLE answers "
                  f"retried: {f.retries}."]
    lines += ["", "Request generations strictly increasing across key expiry and loss, on one Redis and on",
              f"the cluster: `{MONOTONICITY_TEST}`."]
    return "\n".join(lines) + "\n"


def write_plot(results: Sequence[Measurement], path: Path) -> Path:
    """ops/s against client count per operation: each backend x service variant, and the
    direct script (dashed) (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, len(OPERATIONS), figsize=(12, 4.5))
    for axes, operation in zip(panels, OPERATIONS, strict=True):
        series = dict.fromkeys((m.backend, m.path, m.processes) for m in results
                               if m.operation == operation and m.path in (*SERVICE_PATHS, "redis-direct"))
        for backend, path_name, processes in series:
            points = sorted((m for m in results if (m.backend, m.operation, m.path, m.processes)
                             == (backend, operation, path_name, processes)), key=lambda m: m.clients)
            label = f"{backend} direct" if path_name == "redis-direct" else f"{backend} {variant_label(points[0])}"
            axes.plot([m.clients for m in points], [m.ops_per_s for m in points],
                      "--" if path_name == "redis-direct" else "-", marker="o", label=label)
        axes.set(xscale="log", xlabel="concurrent clients", ylabel=f"{operation} ops/s")
        axes.legend(fontsize=7)
    figure.suptitle("policy service: one Redis vs Redis Cluster, one vs two processes")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
