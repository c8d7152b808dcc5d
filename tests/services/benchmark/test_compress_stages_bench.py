"""`kvrelay bench compress` on a tiny shape: every stage is reported for every manifest, the
receipt it reports is the compression's own, and a malformed shape is refused by name (no
timing is checked)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from services.benchmark.compress_stages import (
    BenchConfig,
    Shape,
    run,
    synthetic_prefill,
    time_stages,
)
from services.benchmark.errors import InvalidBenchConfig
from services.kvpolicy.compress import STAGES, StateIdentity, compress
from services.kvpolicy.manifest import DType, TensorContract, default_manifests

torch.set_num_threads(1)

TINY = BenchConfig(
    shape=Shape(2, 2, 96), q_heads=4, head_dim=8, repeats=1, sampler_batch=4, vocab=64
)


def test_every_stage_of_every_manifest_is_reported(tmp_path: Path) -> None:
    out = tmp_path / "compress-stages.md"
    text = run(TINY, out, "kvrelay bench compress --synthetic-shape 2x2x96")
    assert out.read_text() == text
    assert "| manifest | " + " | ".join(STAGES) + " | total |" in text
    for name in TINY.manifests:
        assert f"| {name} |" in text
    assert "Sampler: one `sample` call, batch 4" in text


def test_the_reported_receipt_is_the_compressions_own() -> None:
    (timed,) = time_stages(dataclasses.replace(TINY, manifests=("snapkv-adakv",)))
    tensor = TensorContract(2, 4, 2, 8, DType.BFLOAT16, DType.BFLOAT16)
    manifest = default_manifests(tensor, observation_window=TINY.observation_window)["snapkv-adakv"]
    compressed = compress(manifest, synthetic_prefill(TINY), StateIdentity("bench", 1))
    assert timed.digest == compressed.receipt.digest
    assert timed.retained_rows == compressed.view.total_rows
    assert set(timed.ms) == set(STAGES)


@pytest.mark.parametrize("text", ["24x4", "24x0x16", "axbxc", "24x4x16x2"])
def test_a_malformed_shape_is_refused_by_name(text: str) -> None:
    with pytest.raises(InvalidBenchConfig, match="synthetic_shape"):
        Shape.parse(text)


def test_a_baseline_run_is_compared_stage_by_stage(tmp_path: Path) -> None:
    config = dataclasses.replace(TINY, manifests=("snapkv",))
    before = tmp_path / "before.json"
    run(config, tmp_path / "before.md", "before", json_out=before)
    text = run(config, tmp_path / "after.md", "after", baseline=before, baseline_label="earlier")
    assert "## Before (earlier) and after (this run)" in text
    for stage in (*STAGES, "total"):
        assert f"| snapkv | {stage} |" in text
    # the gathered bytes compared, whatever receipt format each run used
    assert "| snapkv | gathered view (positions, offsets, K, V) | | | the same |" in text
    legacy = json.loads(before.read_text())
    del legacy["stages"]["snapkv"]["view_digest"]  # a baseline from before view digests
    before.write_text(json.dumps(legacy))
    text = run(config, tmp_path / "after.md", "after", baseline=before, baseline_label="old")
    assert "| snapkv | receipt digest | | | the same |" in text
    assert "| sampler | one call |" in text
