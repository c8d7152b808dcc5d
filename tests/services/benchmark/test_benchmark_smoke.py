"""`kvrelay bench --preset smoke` end to end through the CLI: real measurement processes for
kvrelay, transformers and kvpress on the demo checkpoint and a tiny random Llama, the copy
reference and a real gloo transfer. Checks the outputs, that every measured number is
positive and finite, that kvrelay's packed view at the full budget decodes exactly the
full cache's tokens, that the kvpress anchor produced tokens from a compressed cache, and
that every kvrelay compression reports its ledger's transaction peak beside the measured one."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from kvrelay.cli import app
from services.benchmark.config import SMOKE_SHAPE, preset

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(240)

SMOKE = preset("smoke")
RATIOS = ("kvrelay_full", "bytes_vs_full", "transformers", "kvpress")
POSITIVE = (
    "prefill_s",
    "ms_per_token",
    "tokens_per_s",
    "kept_rows",
    "kv_bytes",
    "achieved_bytes_per_s",
    "bandwidth_fraction",
)


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench")
    result = CliRunner().invoke(app, ["bench", "--preset", "smoke", "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out, json.loads((out / "bench.json").read_text()), result.output


def runs_of(data: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    return [r for r in data["runs"] if all(r[k] == v for k, v in match.items())]


def test_writes_json_markdown_and_plots(bench: tuple[Path, dict[str, Any], str]) -> None:
    out, data, output = bench
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == [
        "bandwidth_demo.png",
        "bandwidth_large.png",
        "compression_overhead.png",
        "decode_demo.png",
        "decode_large.png",
    ]
    assert all((out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in pngs)
    text = (out / "bench.md").read_text()
    assert "## Goals" in text and "kvpress stores GQA caches per K/V head" in text
    assert all(f"![{name}]({name})" in text for name in pngs)
    assert [g["status"] in ("PASS", "FAIL", "N/A") for g in data["goals"]] == [True] * 4
    assert data["goals"][3]["status"] in ("PASS", "FAIL")  # the transfer always runs
    printed = [line for line in output.splitlines() if line.startswith(("PASS ", "FAIL ", "N/A  "))]
    assert len(printed) == 4, output


def test_every_configuration_is_measured_with_positive_finite_numbers(
    bench: tuple[Path, dict[str, Any], str],
) -> None:
    _, data, _ = bench
    expected = set()
    for model in ("demo", "large"):
        for context in SMOKE.contexts:
            expected |= {
                (model, "kvrelay-full", context, 1.0),
                (model, "transformers", context, 1.0),
            }
            expected |= {(model, "kvrelay-snapkv", context, b) for b in SMOKE.budgets}
            expected |= {(model, "kvpress-snapkv", context, b) for b in SMOKE.compressed_budgets}
    assert {(r["model"], r["engine"], r["context"], r["budget"]) for r in data["runs"]} == expected
    assert len(data["runs"]) == len(expected) and not data["skips"]
    for run in data["runs"]:
        numbers = [run[k] for k in POSITIVE] + list(run["step_s"])
        numbers += [
            run[phase][k]
            for phase in ("prefill_memory", "decode_memory")
            for k in ("start", "peak")
        ]
        assert all(math.isfinite(x) and x > 0 for x in numbers), run
        assert (
            len(run["step_s"]) == SMOKE.total_steps and len(run["tokens"]) == SMOKE.total_steps + 1
        )
    for number in (
        data["bandwidth"]["bytes_per_s"],
        data["transfer"]["ratio"],
        data["transfer"]["gloo_bytes_per_s"],
        data["transfer"]["tcp_bytes_per_s"],
    ):
        assert math.isfinite(number) and number > 0


def test_packed_view_at_full_budget_decodes_the_full_cache_tokens(
    bench: tuple[Path, dict[str, Any], str],
) -> None:
    _, data, _ = bench
    for model in ("demo", "large"):
        for context in SMOKE.contexts:
            (full,) = runs_of(data, model=model, engine="kvrelay-full", context=context)
            (packed,) = runs_of(
                data, model=model, engine="kvrelay-snapkv", context=context, budget=1.0
            )
            assert packed["tokens"] == full["tokens"]
            assert (
                packed["kept_rows"] == full["kept_rows"] and packed["kv_bytes"] == full["kv_bytes"]
            )
            assert packed["compression_overhead"] > 0 and full["compression_overhead"] is None
    for ratio in data["ratios"]:  # kvrelay SnapKV over its full cache and over each anchor
        assert all(
            v is None or (math.isfinite(v) and v > 0) for k, v in ratio.items() if k in RATIOS
        )
        assert (ratio["kvpress"] is None) == (ratio["budget"] == 1.0)
        assert (
            ratio["bytes_vs_full"] == 1.0 if ratio["budget"] == 1.0 else ratio["bytes_vs_full"] < 1
        )


def test_kvpress_decodes_from_a_compressed_cache_and_kvrelay_keeps_its_budget(
    bench: tuple[Path, dict[str, Any], str],
) -> None:
    _, data, _ = bench
    facts = {f["name"]: f for f in data["models"]}
    for run in runs_of(data, engine="kvpress-snapkv") + runs_of(data, engine="kvrelay-snapkv"):
        owners = facts[run["model"]]["num_layers"] * facts[run["model"]]["num_kv_heads"]
        kept_per_owner = run["kept_rows"] / owners
        if run["engine"] == "kvpress-snapkv":  # kvpress: int(T * (1 - compression_ratio)) rows
            assert kept_per_owner == int(run["context"] * (1 - (1 - run["budget"])))
        else:
            assert kept_per_owner == math.ceil(run["context"] * run["budget"] - 1e-9)
        assert run["kv_bytes"] == run["kept_rows"] * 2 * facts[run["model"]]["head_dim"] * 4
        vocab = 1154 if run["model"] == "demo" else SMOKE_SHAPE.vocab_size
        assert all(0 <= t < vocab for t in run["tokens"])


def test_every_compression_compares_its_ledger_peak_with_the_measured_peak(
    bench: tuple[Path, dict[str, Any], str],
) -> None:
    out, data, output = bench
    for run in data["runs"]:
        peak = run["transaction"]
        assert (peak is None) == (run["engine"] != "kvrelay-snapkv"), run["engine"]
        if peak is None:
            continue
        assert peak["ledger_peak"] == max(peak["phases"].values()) > 0
        assert set(peak["phases"]) == {"score", "allocate", "select", "pack", "offload"}
        memory = peak["compression"]
        assert memory["start"] == run["prefill_memory"]["start"]
        assert memory["start"] < memory["peak"] <= run["prefill_memory"]["peak"]
        ratio = run["transaction_ratio"]
        assert math.isfinite(ratio) and ratio == peak["ledger_peak"] / (
            memory["peak"] - memory["start"]
        )
    text = (out / "bench.md").read_text()
    for model in ("demo", "large"):
        section = text.split(f"### Transaction peak, model `{model}`: ledger vs measured")[1]
        table = [line for line in section.split("\n\n")[1].splitlines() if line.startswith("| ")]
        assert len(table) == 1 + len(SMOKE.contexts) * len(SMOKE.budgets), section[:400]
    assert "transaction peak, model demo" in output
