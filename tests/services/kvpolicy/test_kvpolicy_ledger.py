"""Byte ledger: the issue's exact byte counts, the running-shape read ratio, and the
transaction peak's workspace terms on the wire (the codec and the gateway's summary)."""

from __future__ import annotations

import pytest
import torch

from services.gateway.summary import Route, TokenClock, build_summary
from services.kvpolicy.errors import PackingError
from services.kvpolicy.ledger import Ledger, build_ledger, decode_read_rows, ledger_for
from services.kvpolicy.manifest import DType, TensorContract, default_manifests
from services.kvpolicy.packing import pack
from services.rpc.kvrelay.v1 import decode_pb2, prefill_pb2
from services.transfer import DescriptorInvalid
from services.transfer.codec import ledger_from_proto, ledger_to_proto

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
    assert ledger.position_grid_bytes == 8 * 16 + 8 * 4  # int64 positions and counts
    assert ledger.transaction_peak_bytes == 512 + 256 + 88 + 160


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


WORKSPACE_FIELDS = (
    "source_rows", "observation_bytes", "score_bytes", "score_workspace_bytes",
    "allocator_workspace_bytes", "selection_workspace_bytes", "compaction_workspace_bytes",
)


def adakv_ledger() -> Ledger:
    """Ada-KV over 64 tokens of a GQA contract (H_q 4 on H_kv 2), W_obs 8, budget 25%."""
    contract = TensorContract(2, 4, 2, 4, DType.FLOAT32, DType.FLOAT32)
    manifest = default_manifests(contract, observation_window=8)["snapkv-adakv"]
    protected = tuple(range(56, 64))
    selected = [[(0, 9, 30, 41) + protected, (3, 5, 7, 50) + protected] for _ in range(2)]
    return ledger_for(manifest, 64, selected)


def test_the_workspace_terms_follow_the_formulas() -> None:
    ledger = adakv_ledger()
    assert ledger.source_rows == 2 * 2 * 64
    # the runtime's vote [L, H_q, T - W] fp32 and per-layer extremes (the rows are not kept)
    assert ledger.observation_bytes == 4 * 2 * 4 * 56 + 2 * 4 * 2
    assert ledger.score_bytes == 4 * 2 * 2 * 56  # [L, H_kv, T - W] fp32
    vote = 4 * 2 * 4 * 56  # [L, H_q, T - W] fp32
    # one layer at a time: the owner scores [L, H_kv, T - W], beside one layer's pooled votes
    # (avg pooling adds its window sums into one output) and their H_kv reduced rows
    pooling = 4 * 2 * 2 * 56 + vote // 2 + 2 * 4 * 56
    assert ledger.score_workspace_bytes == pooling
    # one layer's position-major copy and its k-th-value selection's scratch copy and result
    assert ledger.allocator_workspace_bytes == 8 * 2 * 56 + 4
    # the finished grid (48 int64 positions, 4 counts) beside the protected positions (int64)
    # and the four owners' chosen positions (4 each, int64); above the last owner's
    # k-th-value selection beside the three before it
    assert ledger.selection_workspace_bytes == 8 * (48 + 4) + 8 * 8 + 8 * 4 * 4
    # the receipt's int32 copy of the state's positions and int64 copy of the view's
    # offsets, above the view check's mask
    assert ledger.compaction_workspace_bytes == 4 * 48 + 8 * 2 * 3
    phases = ledger.transaction_phases
    assert list(phases) == ["score", "allocate", "select", "pack", "offload"]
    observation = 4 * 2 * 4 * 56 + 2 * 4 * 2
    assert phases["score"] == ledger.source_payload_bytes + observation + pooling
    assert ledger.transaction_peak_bytes == phases["pack"] > phases["score"]
    view = ledger.visible_payload_bytes + ledger.position_map_bytes + ledger.offsets_bytes
    view += ledger.position_grid_bytes
    assert ledger.position_grid_bytes == 8 * 48 + 8 * 2 * 2
    assert phases["pack"] == (
        ledger.source_payload_bytes + observation + 896 + view + ledger.compaction_workspace_bytes
    )


def test_a_ledger_without_a_manifest_keeps_the_packing_peak() -> None:
    ledger = build_ledger(SMALL, 8, SELECTED)
    assert all(getattr(ledger, name) == 0 for name in WORKSPACE_FIELDS[1:])
    assert ledger.transaction_phases["pack"] == ledger.transaction_phases["offload"] == 856 + 160


def test_the_workspace_travels_on_the_wire_and_reaches_the_summary() -> None:
    ledger = adakv_ledger()
    message = ledger_to_proto(ledger, bytes_moved=ledger.traffic_bytes)
    assert {name: getattr(message, name) for name in WORKSPACE_FIELDS} == {
        name: getattr(ledger, name) for name in WORKSPACE_FIELDS
    }
    assert message.transaction_peak_bytes == ledger.transaction_peak_bytes
    assert ledger_from_proto(message) == ledger
    tampered = type(message)()
    tampered.CopyFrom(message)
    tampered.compaction_workspace_bytes += 4  # a term of the peak phase (pack)
    with pytest.raises(DescriptorInvalid) as caught:
        ledger_from_proto(tampered)
    assert caught.value.field == "ledger" and "transaction_peak_bytes" in caught.value.reason
    tampered.compaction_workspace_bytes -= 4
    tampered.score_workspace_bytes = -1
    with pytest.raises(DescriptorInvalid) as caught:
        ledger_from_proto(tampered)
    assert caught.value.field == "ledger.score_workspace_bytes"
    summary = build_summary(
        Route("req", "sha", 64, "p", "d"),
        prefill_pb2.PrefillResponse(),
        decode_pb2.DecodeSummary(ledger=message),
        TokenClock(),
    )
    assert summary.ledger.observation_bytes == ledger.observation_bytes
    assert summary.ledger.transaction_peak_bytes == ledger.transaction_peak_bytes
