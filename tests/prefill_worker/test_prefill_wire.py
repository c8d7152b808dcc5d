"""Validation at the RPC edge (every bad field is named), the config's own validation, and the
bounded admission queue."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from prefill_worker.admission import Admission
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.wire import RequestLimits, parse_prefill_request
from services.rpc.errors import InvalidArgument, ResourceExhausted
from services.rpc.kvrelay.v1 import common_pb2, prefill_pb2
from services.transfer import PairGroupConfig
from services.transfer.codec import sampling_from_proto, sampling_to_proto

LIMITS = RequestLimits(vocab_size=97, max_prompt_tokens=32, context_length=40)
SHA = "ab" * 32


def request(**overrides: object) -> prefill_pb2.PrefillRequest:
    fields: dict[str, object] = {
        "request_id": "req-1",
        "request_generation": 2,
        "prompt_token_ids": [5, 6, 7],
        "sampling": common_pb2.SamplingParams(temperature=0.7, top_k=5, seed=9, max_tokens=4, stop_token_ids=[3]),
        "manifest_sha256": SHA,
        "decode_worker_address": "127.0.0.1:50063",
        "decode_worker_id": "decode-0",
        "trace_context": {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    }
    fields.update(overrides)
    return prefill_pb2.PrefillRequest(**fields)  # type: ignore[arg-type]


def test_a_valid_request_parses_into_a_call() -> None:
    call = parse_prefill_request(request(), LIMITS)
    assert call.prompt_ids == (5, 6, 7) and call.max_tokens == 4
    assert call.sampling.temperature == pytest.approx(0.7) and call.sampling.top_p == 1.0
    assert call.sampling.seed == 9 and call.sampling.stop_token_ids == (3,)
    assert call.decode.address == "127.0.0.1:50063" and call.decode.worker_id == "decode-0"
    assert dict(call.trace_context)["traceparent"].startswith("00-0af7")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": list(range(3, 36))}, "prompt_token_ids"),
        ({"prompt_token_ids": [5, 97]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [-1]}, "prompt_token_ids[0]"),
        ({"request_id": ""}, "request_id"),
        ({"request_generation": 0}, "request_generation"),
        ({"manifest_sha256": "AB" * 32}, "manifest_sha256"),
        ({"manifest_sha256": ""}, "manifest_sha256"),
        ({"decode_worker_address": ""}, "decode_worker_address"),
        ({"decode_worker_address": "decode:port"}, "decode_worker_address"),
        ({"decode_worker_id": ""}, "decode_worker_id"),
        ({"decode_worker_id": "a/b"}, "decode_worker_id"),
        ({"sampling": common_pb2.SamplingParams(max_tokens=0)}, "sampling.max_tokens"),
        # The gateway's rule, re-checked: 3 prompt tokens leave 37 of the context of 40.
        ({"sampling": common_pb2.SamplingParams(max_tokens=38)}, "sampling.max_tokens"),
        ({"sampling": common_pb2.SamplingParams(max_tokens=1, temperature=math.inf)}, "sampling.temperature"),
        ({"sampling": common_pb2.SamplingParams(max_tokens=1, stop_token_ids=[1] * 65)}, "sampling.stop_token_ids"),
        ({"sampling": common_pb2.SamplingParams(max_tokens=1, temperature=-1)}, "sampling.temperature"),
        ({"sampling": common_pb2.SamplingParams(max_tokens=1, temperature=math.nan)}, "sampling.temperature"),
        ({"sampling": common_pb2.SamplingParams(max_tokens=1, top_p=1.5)}, "sampling.top_p"),
        ({"sampling": common_pb2.SamplingParams(max_tokens=1, top_k=-2)}, "sampling.top_k"),
        ({"sampling": common_pb2.SamplingParams(max_tokens=1, stop_token_ids=[1, 200])}, "sampling.stop_token_ids[1]"),
    ],
)
def test_every_bad_field_is_named(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_prefill_request(request(**overrides), LIMITS)
    assert caught.value.field == field


def test_a_field_sent_with_the_wrong_wire_type_is_rejected() -> None:
    wire = bytearray(request().SerializeToString())
    wire += bytes([2 << 3 | 2, 1, ord("x")])  # request_generation (field 2) as a string
    with pytest.raises(InvalidArgument) as caught:
        parse_prefill_request(prefill_pb2.PrefillRequest.FromString(bytes(wire)), LIMITS)
    assert caught.value.field == "request_generation"


def test_sampling_round_trips_through_the_wire() -> None:
    message = common_pb2.SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=11, max_tokens=7, stop_token_ids=[4])
    call = parse_prefill_request(request(sampling=message), LIMITS)
    assert sampling_from_proto(message) == (call.sampling, call.max_tokens)
    assert sampling_to_proto(call.sampling, call.max_tokens) == message


def test_config_names_the_bad_field(tmp_path: Path) -> None:
    PrefillWorkerConfig(checkpoint=tmp_path)
    cases = {
        "worker_id": {"worker_id": "has space"},
        "max_in_flight": {"max_in_flight": 0},
        "max_queued": {"max_queued": -1},
        "transfer_timeout_s": {"transfer_timeout_s": 0},
        "accept_timeout_s": {"accept_timeout_s": 60.0},
        "device": {"device": "tpu"},
        "dtype": {"dtype": "int8"},
        "policy_address": {"policy_address": "nowhere"},
        "pair_groups.max_groups": {"max_in_flight": 4, "pair_groups": PairGroupConfig(max_groups=2)},
    }
    for field, overrides in cases.items():
        with pytest.raises(ValueError, match=rf"^{field}:"):
            PrefillWorkerConfig(checkpoint=tmp_path, **overrides)  # type: ignore[arg-type]


async def test_admission_runs_n_queues_q_and_refuses_the_rest() -> None:
    admission = Admission(max_in_flight=2, max_queued=1)
    release = asyncio.Event()
    order: list[int] = []

    async def hold(index: int) -> None:
        async with admission.slot():
            order.append(index)
            await release.wait()

    holders = [asyncio.create_task(hold(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert (admission.in_flight, admission.queued) == (2, 1)
    with pytest.raises(ResourceExhausted):
        async with admission.slot():
            pass
    release.set()
    await asyncio.wait_for(asyncio.gather(*holders), 5)
    assert order == [0, 1, 2]
    assert (admission.in_flight, admission.queued) == (0, 0)


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    admission = Admission(max_in_flight=1, max_queued=1)
    release = asyncio.Event()

    async def hold() -> None:
        async with admission.slot():
            await release.wait()

    running, waiting = asyncio.create_task(hold()), asyncio.create_task(hold())
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.sleep(0.01)
    assert (admission.in_flight, admission.queued) == (1, 0)
    third = asyncio.create_task(hold())  # the freed queue place is usable again
    await asyncio.sleep(0.01)
    assert admission.queued == 1
    release.set()
    await asyncio.wait_for(asyncio.gather(running, third), 5)
