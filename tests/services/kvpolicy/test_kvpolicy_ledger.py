"""Byte ledger: the issue's exact byte counts and the running-shape read ratio."""

from __future__ import annotations

import pytest
import torch

from services.kvpolicy.errors import PackingError
from services.kvpolicy.ledger import build_ledger, decode_read_rows
from services.kvpolicy.manifest import DType, TensorContract
from services.kvpolicy.packing import pack

torch.set_num_threads(1)

SELECTED = [[[0, 2, 5, 7], [0, 1, 6, 7]], [[0, 3, 4, 7], [0, 2, 6, 7]]]
SMALL = TensorContract(
    num_layers=2,
    num_q_heads=2,
    num_kv_heads=2,
    head_dim=4,
    k_dtype=DType.FLOAT16,
    v_dtype=DType.FLOAT16,
)
RUNNING = TensorContract(
    num_layers=32,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    k_dtype=DType.BFLOAT16,
    v_dtype=DType.BFLOAT16,
)


def test_issue_example_bytes() -> None:
    ledger = build_ledger(SMALL, 8, SELECTED)
    assert ledger.bytes_per_row == 16
    assert ledger.full_payload_bytes == 512
    assert ledger.visible_payload_bytes == 256
    assert ledger.position_map_bytes == 64
    assert ledger.offsets_bytes == 24
    assert ledger.omitted_payload_bytes == 256
    assert ledger.traffic_bytes == 256 + 64 + 24
    assert ledger.transaction_peak_bytes == 512 + 256 + 88


def test_ledger_equals_the_bytes_of_the_packed_view() -> None:
    k = torch.zeros(2, 2, 8, 4, dtype=torch.float16)  # [L, H_kv, T, d_h]
    view = pack(k, k.clone(), SELECTED)
    ledger = build_ledger(SMALL, 8, SELECTED)
    assert view.payload_bytes == ledger.visible_payload_bytes
    assert view.metadata_bytes == ledger.metadata_bytes
    assert view.payload_bytes + view.metadata_bytes == ledger.traffic_bytes


def test_running_shape() -> None:
    assert RUNNING.bytes_per_row == 512
    assert RUNNING.bytes_per_token == 128 * 1024
    full = decode_read_rows(32768, 512)
    bounded = decode_read_rows(32768, 512, row_bound=4096)
    assert bounded == 512 * 4096
    assert full / bounded == 8.0623779296875


def test_decode_read_rows_small_cases() -> None:
    assert decode_read_rows(3, 4) == 3 + 4 + 5 + 6
    assert decode_read_rows(3, 4, row_bound=5) == 3 + 4 + 5 + 5
    assert decode_read_rows(0, 0) == 0
    with pytest.raises(PackingError):
        decode_read_rows(-1, 2)


def test_unique_vs_query_expanded_demand() -> None:
    gqa = TensorContract(
        num_layers=1,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=2,
        k_dtype=DType.FLOAT16,
        v_dtype=DType.FLOAT16,
        q_to_kv_head_map=(0, 0, 1, 1),
    )
    per_kv = build_ledger(gqa, 6, [[[0, 1], [2, 3, 4]]])
    assert (per_kv.visible_rows, per_kv.unique_kv_rows, per_kv.query_expanded_rows) == (5, 5, 10)
    per_q = build_ledger(gqa, 6, [[[0, 1], [1, 2], [3], [3]]], owner_to_kv_head=(0, 0, 1, 1))
    assert per_q.owners_are_query_heads and per_q.num_owners == 4
    assert (per_q.visible_rows, per_q.unique_kv_rows, per_q.query_expanded_rows) == (6, 4, 6)
    assert per_q.full_rows == 4 * 6
    assert per_q.offsets_bytes == 1 * 5 * 4


def test_ledger_rejects_a_grid_of_the_wrong_shape() -> None:
    with pytest.raises(PackingError) as info:
        build_ledger(SMALL, 8, SELECTED[:1])
    assert info.value.field == "selected"
