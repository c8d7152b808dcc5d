"""`kvrelay bench policy` runs end to end (tiny settings) and its arithmetic is right."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import redis

from policy_service.bench import (
    BenchConfig,
    BenchRun,
    Measurement,
    percentile,
    resp_command,
    run_bench,
    variants,
)
from policy_service.bench_report import MONOTONICITY_TEST, render_markdown, report_rows, write_plot
from policy_service.failover import FailoverResult
from services.redis_embedded import EmbeddedRedis


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([3.0], 99) == 3.0


def test_resp_command_is_what_redis_parses() -> None:
    assert resp_command("EVALSHA", "ab", 1, "k") == b"*4\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n1\r\n$1\r\nk\r\n"
    with EmbeddedRedis() as server, redis.Redis.from_url(server.url) as client:
        client.set("k", "v")
        connection = client.connection_pool.get_connection()
        connection.send_packed_command([resp_command("GET", "k")])
        assert connection.read_response() == b"v"
        client.connection_pool.release(connection)


def test_report_pairs_each_service_row_with_its_ceilings() -> None:
    results = [
        Measurement("GetFence", "service", 16, 500, 1.0, 2.0, 9.0),
        Measurement("GetFence", "redis-direct", 16, 1000, 1.0, 1.0, 3.0),
        Measurement("GetFence", "redis-cli-pipe", 1, 10_000, 0.5, math.nan, math.nan),
        Measurement("Health", "service", 16, 900, 1.0, 0.5, 1.0),
    ]
    fence, health = report_rows(results)
    assert (fence["ops_per_s"], fence["ceiling_ops_per_s"], fence["ratio"], fence["pipe_ops_per_s"]) \
        == (500, 1000, 0.5, 20_000)
    assert (health["operation"], health["ceiling_ops_per_s"], health["ratio"]) == ("Health", None, None)


def test_the_markdown_names_variants_goals_failover_and_the_monotonicity_test(tmp_path: Path) -> None:
    results = [
        Measurement(op, path, clients, ops, 1.0, p50, 2.0, backend=backend, processes=processes)
        for backend, path, processes, op, clients, ops, p50 in [
            ("single", "service", 1, "PublishState", 1, 500, 1.0),
            ("single", "redis-direct", 1, "PublishState", 1, 2000, 0.4),
            ("single", "service", 1, "PublishState", 64, 2400, 20.0),
            ("single", "service", 2, "PublishState", 64, 3600, 15.0),
            ("single", "service-unpipelined", 1, "PublishState", 64, 1200, 50.0),
            ("single", "service-unary", 1, "PublishState", 1, 800, 1.6),
            ("single", "service-unary", 1, "PublishState", 64, 1600, 40.0),
            ("single", "redis-direct", 1, "PublishState", 64, 4000, 10.0),
            ("cluster", "service", 1, "GetFence", 64, 3000, 12.0),
            ("cluster", "service", 1, "PublishState", 16, 900, 4.0),
            ("cluster", "service-no-wait", 1, "PublishState", 16, 1000, 3.5),
            ("single", "service-framed", 1, "PublishState", 1, 1500, 0.7),
            ("single", "service-framed", 1, "PublishState", 64, 4800, 12.0),
            ("single", "service-framed-paired", 1, "GetFence", 1, 1600, 0.6),
            ("single", "redis-direct-paired", 1, "GetFence", 1, 4000, 0.25),
        ]
    ]
    failover = FailoverResult(requests=8, acknowledged=80, read_back=80, missing=0, torn=0,
                              acknowledged_while_unreplicated=0, resumed=30, retries=5, failover_s=2.0)
    text = render_markdown(BenchRun(results, failover), "kvrelay bench policy --scale", "2 CPUs")
    assert "| single | 2 processes, gRPC Session | PublishState | 64 | 3600 |" in text
    assert "| single | 1 process, framed sessions (no gRPC) | PublishState | 64 | 4800 |" in text
    assert "Framed sessions, one client, PublishState p50: 0.700 ms, direct script 0.400 ms (ratio 1.75; " \
           "goal <= 2), gRPC Session 1.000 ms" in text
    assert "Framed sessions, 64 clients, one process, PublishState: 4800 ops/s, gRPC Session 2400 (x2.00)" in text
    assert "**Paired**" in text and "GetFence p50: 0.600 ms vs 0.250 ms direct (ratio 2.40; goal <= 2)" in text
    assert "paired" not in "".join(line for line in text.splitlines() if line.startswith("|"))  # not table rows
    assert "| single | 1 process, unary, unpipelined (before) | PublishState | 64 | 1200 |" in text
    assert "| single | 1 process, unary calls (no Session) | PublishState | 64 | 1600 |" in text
    assert "(ratio 2.50; goal <= 2); unary calls (no Session) 1.600 ms" in text
    assert "x2.00" in text and "unary calls 1600 ops/s: x1.50" in text and "x1.50 one process" in text
    assert "| cluster | 1 process, no WAIT | PublishState | 16 | 1000 |" in text
    assert "WAIT 1 on the cluster, PublishState at 16 clients: p50 4.000 ms vs 3.500 ms without" in text
    assert "read back from the promoted replica: 80 of 80**" in text and MONOTONICITY_TEST in text
    assert write_plot(results, tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_the_variants_are_the_replica_counts_and_the_path_before() -> None:
    found = variants(BenchConfig(processes=(1, 2), unpipelined=True))
    assert [(v.path, v.processes, v.args, v.session_streams, v.framed) for v in found] == [
        ("service-framed", 1, (), 2, True), ("service-framed", 2, (), 2, True),
        ("service", 1, (), 2, False), ("service", 2, (), 2, False), ("service-unary", 1, (), 0, False),
        ("service-unpipelined", 1, ("--no-redis-pipelining",), 0, False)]
    on_cluster = variants(BenchConfig(unpipelined=True), "cluster")
    assert [(v.path, v.args) for v in on_cluster][-1] == ("service-no-wait", ("--redis-wait-replicas", "0"))
    with pytest.raises(ValueError, match="target"):
        BenchConfig(redis_url="redis://x:1", target="127.0.0.1:1", processes=(2,))


@pytest.mark.slow
async def test_bench_runs_end_to_end_with_two_replicas_on_one_redis_and_on_a_cluster() -> None:
    # Warm-up long enough for a loaded host to open the first connections to every node.
    config = BenchConfig(concurrency=(2,), seconds=0.5, warmup_s=0.5, pipe_commands=300,
                         backends=("single", "cluster"), processes=(2,))
    run = await run_bench(config)
    paths = {(m.backend, m.operation, m.path, m.processes) for m in run.measurements}
    for backend in ("single", "cluster"):
        for operation in ("PublishState", "GetFence"):
            assert {(backend, operation, "service", 2), (backend, operation, "service-framed", 2),
                    (backend, operation, "redis-direct", 1),
                    (backend, operation, "redis-cli-pipe", 1)} <= paths
        assert (backend, "Health", "service", 2) in paths
        assert (backend, "Refused", "service-framed", 2) in paths  # answered, refused, before Redis
    assert ("single", "Echo", "frame-echo", 1) in paths and ("cluster", "Echo", "frame-echo", 1) not in paths
    # The paired one-client rounds: only on one Redis, only with one framed process (none here).
    assert not any(m.path.endswith("-paired") for m in run.measurements)
    assert all(m.ops > 0 and m.ops_per_s > 0 for m in run.measurements)
    assert len(report_rows(run.measurements)) == 2 * 6 and run.failover is None


@pytest.mark.slow
async def test_paired_rounds_time_framed_sessions_and_the_direct_script_alike() -> None:
    config = BenchConfig(concurrency=(1,), seconds=0.2, warmup_s=0.05, pipe_commands=100, paired_rounds=2)
    run = await run_bench(config)
    paired = {(m.operation, m.path): m for m in run.measurements if m.path.endswith("-paired")}
    assert set(paired) == {(op, path) for op in ("PublishState", "GetFence")
                           for path in ("service-framed-paired", "redis-direct-paired")}
    for m in paired.values():  # 2 rounds x 2 slots of 0.1 s each, pooled
        assert m.clients == 1 and m.ops > 0 and m.seconds == pytest.approx(0.4)
        assert 0 < m.p50_ms <= m.p99_ms
