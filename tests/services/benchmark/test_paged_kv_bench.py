"""`kvrelay bench paged-kv` on a tiny run: the report's memory columns (no timing is checked):
the paged cache allocates the ledger rounded up to pages, the padded slab more."""

from __future__ import annotations

import torch

from services.benchmark.paged_kv import BenchConfig, ViewMaker, run, run_batch
from services.model.loader import load

torch.set_num_threads(1)


def test_paged_allocation_follows_the_ledger_and_the_slab_does_not():
    config = BenchConfig(context=256, batch=4, steps=1, full_contexts=(64,), budget_mib=1)
    loaded = load(config.checkpoint, dtype="float32")
    maker = ViewMaker(loaded, seed=0)
    views = [maker.uniform(256, 1.0)] + [maker.uniform(256, 0.1) for _ in range(3)]
    result = run_batch(loaded, "mixed", views, 256, config)
    assert result.paged.ledger_bytes == result.padded.ledger_bytes
    segments = 4 * loaded.config.num_layers * loaded.config.num_kv_heads
    # Every (request, layer, owner) rounds up to 16-row pages: at most 15 rows more each.
    row_bytes = 2 * loaded.config.head_dim * 4 + 4
    slack = segments * 15 * row_bytes
    assert result.paged.ledger_bytes <= result.paged.allocated_bytes <= result.paged.ledger_bytes + slack
    assert result.padded.allocated_bytes > 3 * result.paged.allocated_bytes  # the full one's span


def test_the_report_has_the_issue_table(tmp_path):
    out = tmp_path / "paged-kv.md"
    run(BenchConfig(context=128, batch=2, steps=1, full_contexts=(64,), budget_mib=1), out)
    text = out.read_text()
    assert "| batch | cache | ledger | allocated | allocated / ledger | step ms |" in text
    assert "1 full 128 + 1 x 10% of 128" in text and "mixed / predicted" in text
