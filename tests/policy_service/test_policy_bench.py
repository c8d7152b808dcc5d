"""`kvrelay bench policy` runs end to end (tiny settings) and its arithmetic is right."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import redis

from policy_service.bench import (
    BenchConfig,
    Measurement,
    percentile,
    render_markdown,
    report_rows,
    resp_command,
    run_bench,
    write_plot,
)
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
    ]
    (row,) = report_rows(results)
    assert (row["ops_per_s"], row["ceiling_ops_per_s"], row["ratio"]) == (500, 1000, 0.5)
    assert (row["pipe_ops_per_s"], row["pipe_ratio"]) == (20_000, 0.025)


def test_the_markdown_compares_each_cluster_row_with_the_same_single_row(tmp_path: Path) -> None:
    results = [
        Measurement("GetFence", path, 16, ops, 1.0, 1.0, 2.0, backend=backend)
        for backend, path, ops in [("single", "service", 500), ("single", "redis-direct", 1000),
                                   ("cluster", "service", 400), ("cluster", "redis-direct", 1500)]
    ]
    assert [(r["backend"], r["ratio"]) for r in report_rows(results)] == [("single", 0.5), ("cluster", 0.267)]
    text = render_markdown(results, "kvrelay bench policy", "2 CPUs")
    assert "| cluster | GetFence | 16 | 400 |" in text and "| GetFence | 16 | 0.80 | 1.50 |" in text
    assert write_plot(results, tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
async def test_bench_runs_end_to_end_on_one_redis_and_on_a_cluster() -> None:
    # Warm-up long enough for a loaded host to open the first connections to every node.
    config = BenchConfig(concurrency=(1, 2), seconds=1.0, warmup_s=0.5, pipe_commands=300,
                         backends=("single", "cluster"))
    results = await run_bench(config)
    paths = {(m.backend, m.operation, m.path, m.clients) for m in results}
    for backend in ("single", "cluster"):
        for operation in ("PublishState", "GetFence"):
            assert {(backend, operation, "service", 1), (backend, operation, "service", 2),
                    (backend, operation, "redis-direct", 2), (backend, operation, "redis-cli-pipe", 1)} <= paths
    assert all(m.ops > 0 and m.ops_per_s > 0 for m in results)
    assert len(report_rows(results)) == 8
