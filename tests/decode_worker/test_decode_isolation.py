"""One request's bad numbers never fail another's (issue 15, item 1).

A request whose own KV holds a NaN (as a faulty device or an overflow upstream would leave
it) gets a non-finite logits row at its first decode step. It fails alone — `DecodeFailed(
non_finite=True)` in the loop, INTERNAL `NonFiniteDecode` naming it on its stream — and every
other request of its batch decodes exactly what it decodes alone, including the one that moves
into the poisoned request's cache slot and the ones sampled at extreme (valid) temperatures.
In-process on the real scheduler (admission order fixed, so the slot move is certain), then
over real gRPC, a real policy service on real redis and real gloo transfers."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from decode_helpers import (
    KV_BUDGET_BYTES,
    Prefilled,
    new_request_id,
    prompt_ids,
    run_prefill,
    sampling_proto,
)
from test_decode_scheduler import decode_alone, request_for
from test_decode_service import begin_and_publish, collect, transfer

from decode_worker.config import DecodeWorkerConfig, SchedulerConfig
from decode_worker.scheduler import DecodeFailed, DecodeFinished, DecodeScheduler
from decode_worker.server import DecodeWorker
from policy_service.server import PolicyServer
from services.kvpolicy.packing import PackedKVView, pack
from services.model import LoadedModel, SamplingParams
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import decode_pb2_grpc
from services.rpc.server import ServerConfig
from services.telemetry import metrics
from services.transfer import KVSender, PairGroupConfig

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)
WAIT_S = 30.0
POISONED_AT = 40  # a position past every innocent view's own rows
INNOCENT_TOKENS = 400  # long enough to be decoding when the poisoned request arrives
INNOCENT = (  # (prompt length, sampling): extreme but valid values included
    (44, SamplingParams()),
    (20, SamplingParams(temperature=4.6e-38, seed=3)),
    (24, SamplingParams(temperature=1e-45, top_p=1e-300, seed=4)),
    (16, SamplingParams(temperature=0.8, top_k=20, seed=5)),
    (30, SamplingParams(temperature=1e300, top_k=5, seed=6)),
    (12, SamplingParams(temperature=1.0, top_p=0.9, seed=7)),
    (8, SamplingParams()),  # admitted last: it moves into the poisoned request's slot
)


def poisoned(prefilled: Prefilled) -> Prefilled:
    """The same prefill with one V row (layer 0, K/V head 0, `POISONED_AT`) NaN."""
    values = prefilled.result.source_v.clone()  # [L, H_kv, T, d_h]
    values[0, 0, POISONED_AT] = math.nan
    return replace(prefilled, result=replace(prefilled.result, source_v=values))


def full_view(loaded: LoadedModel, prefilled: Prefilled) -> PackedKVView:
    everything = [
        [list(range(prefilled.length))] * loaded.config.num_kv_heads
    ] * loaded.config.num_layers
    return pack(prefilled.result.source_k, prefilled.result.source_v, everything)


def test_a_non_finite_row_fails_its_request_alone_and_the_batch_decodes_as_alone(
    loaded: LoadedModel,
) -> None:
    config = SchedulerConfig(max_batch=8, kv_budget_bytes=64 * 1024 * 1024)
    cases = []
    for index, (length, sampling) in enumerate(INNOCENT):
        prefilled = run_prefill(loaded, prompt_ids(length, seed=700 + index))
        cases.append((f"innocent-{index}", prefilled, full_view(loaded, prefilled), sampling))
    reference = DecodeScheduler(loaded, config)
    reference.start()
    try:
        alone = {name: decode_alone(reference, name, p, v, s, 12) for name, p, v, s in cases}
    finally:
        reference.stop()

    bad = poisoned(run_prefill(loaded, prompt_ids(48, seed=699)))
    batched = DecodeScheduler(loaded, config)
    requests = [request_for(batched, "poisoned", bad, full_view(loaded, bad), SamplingParams(), 12)]
    requests += [request_for(batched, name, p, v, s, 12) for name, p, v, s in cases]
    for request, _ in requests:  # all queued before the loop starts: one batch, in this order
        batched.submit(request)
    failures_before = _non_finite_count()
    batched.start()
    try:
        outcomes = [sink.drain(WAIT_S) for _, sink in requests]
    finally:
        batched.stop()

    tokens, failed = outcomes[0]
    assert tokens == [] and isinstance(failed, DecodeFailed) and failed.non_finite
    assert "request poisoned" in failed.message and "not finite" in failed.message
    assert _non_finite_count() == failures_before + 1
    for (name, *_), (tokens, finished) in zip(cases, outcomes[1:], strict=True):
        expected_tokens, expected_finish = alone[name]
        assert isinstance(finished, DecodeFinished), (name, finished)
        assert [t.token_id for t in tokens] == [t.token_id for t in expected_tokens], name
        assert all(math.isfinite(t.logprob) for t in tokens), name
        assert finished.reason == expected_finish.reason, name
    assert batched.max_batch_seen == len(requests)
    assert batched.budget.used_bytes == 0


def _non_finite_count() -> float:
    return metrics.registry_for("decode").get_sample_value("kvrelay_decode_non_finite_total") or 0.0


@pytest.fixture
async def wide_worker(
    checkpoint: Path, loaded: LoadedModel, policy_server: PolicyServer
) -> AsyncIterator[DecodeWorker]:
    """A decode worker whose batch holds the poisoned request and every innocent one at once."""
    config = DecodeWorkerConfig(
        checkpoint=checkpoint,
        policy_address=policy_server.address,
        worker_id=f"decode-{uuid.uuid4().hex[:6]}",
        server=ServerConfig(port=0, shutdown_grace_s=0.5),
        transfer=PairGroupConfig(store_port=0),
        scheduler=SchedulerConfig(max_batch=8, kv_budget_bytes=KV_BUDGET_BYTES),
        max_new_tokens=1000,
        transfer_timeout_s=10.0,
        lease_timeout_s=5.0,
        policy_timeout_s=5.0,
        receive_threads=4,
    )
    started = await DecodeWorker.start(config, loaded)
    yield started
    await started.stop(0)


@pytest.fixture
def sender() -> Iterator[KVSender]:
    kv_sender = KVSender("prefill-test")
    yield kv_sender
    kv_sender.close()


async def test_poisoned_stream_ends_internal_naming_its_request_and_six_others_finish(
    wide_worker, sender, policy, loaded, manifests
) -> None:
    async with grpc.aio.insecure_channel(wide_worker.address) as channel:
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        innocent = []
        for index, (length, _) in enumerate(INNOCENT[1:]):
            temperature = (0.0, 4.6e-38, 1e-45, 0.9)[index % 4]
            innocent.append(
                _setup(
                    stub,
                    sender,
                    wide_worker,
                    policy,
                    manifests[("full", "snapkv")[index % 2]],
                    run_prefill(loaded, prompt_ids(length, seed=800 + index)),
                    new_request_id(),
                    sampling_proto(INNOCENT_TOKENS, temperature=temperature, seed=index + 1),
                )
            )
        sends = await asyncio.gather(*innocent)
        streams = [asyncio.ensure_future(collect(stub, sent)) for sent in sends]
        scheduler = wide_worker.servicer.scheduler
        await _until(lambda: scheduler.active == len(sends) and scheduler.waiting == 0)
        bad_id = new_request_id()
        bad = await _setup(
            stub,
            sender,
            wide_worker,
            policy,
            manifests["full"],
            poisoned(run_prefill(loaded, prompt_ids(48, seed=699))),
            bad_id,
            sampling_proto(12, temperature=0.7, seed=9),
        )
        outcomes = await asyncio.gather(collect(stub, bad), *streams, return_exceptions=True)

    failed = outcomes[0]
    assert isinstance(failed, grpc.aio.AioRpcError), failed
    assert failed.code() == grpc.StatusCode.INTERNAL
    detail = error_detail(failed)
    assert detail is not None and detail.field == "logits"
    assert bad_id in detail.message and "not finite" in detail.message
    finished = outcomes[1:]
    assert len(finished) >= 6 and [o for o in finished if isinstance(o, BaseException)] == []
    for tokens, summary in finished:  # type: ignore[misc]
        assert summary.output_tokens == len(tokens) >= 1
        assert all(math.isfinite(t.logprob) for t in tokens)
    # All seven shared a step, which can only be the poisoned request's one and only step.
    assert scheduler.max_batch_seen == len(outcomes)
    await _until(
        lambda: scheduler.budget.used_bytes == 0 and wide_worker.servicer.open_transfers == 0
    )


async def _setup(stub, sender, worker, policy, manifest, prefilled, request_id, sampling):
    packed = await begin_and_publish(policy, manifest, prefilled, request_id)
    return await transfer(stub, sender, worker, packed, sampling=sampling)


async def _until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition did not hold in time"
        await asyncio.sleep(0.01)
