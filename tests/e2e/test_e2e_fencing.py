"""A receipt whose state generation was superseded is rejected by the decode worker.

This test plays a prefill worker with the real pipeline stages and the real handoff (gloo
pair group to the decode worker's store, AcceptTransfer, layer-by-layer send): it publishes
state 1 of a request, and then — before sending — a successor state 2 supersedes it. The
decode worker receives the state-1 view, asks the policy service's fence, and refuses it:
StreamTokens fails with FAILED_PRECONDITION (STALE_GENERATION, carrying the current fence).
The same flow without the successor streams tokens, so the refusal is the fence's doing."""

from __future__ import annotations

import grpc
import pytest
from e2e_helpers import UpStack, needle_ids

from prefill_worker.handoff import DecodeHandoff
from prefill_worker.offload import Packed
from prefill_worker.pipeline import PrefillJob, forward, publish
from prefill_worker.wire import DecodeTarget, PrefillCall
from services.kvpolicy.compress import compress
from services.kvpolicy.manifest import default_manifests
from services.model import LoadedModel, SamplingParams
from services.policy import Phase, PolicyClient, PolicyClientConfig, StatePublication
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.transfer import Deadline, KVSender

pytestmark = pytest.mark.timeout(120)


async def send_state_one(
    stack: UpStack, loaded: LoadedModel, policy: PolicyClient, request_id: str, *, supersede: bool
) -> decode_pb2.StreamTokensRequest:
    """Begin, run the pipeline, publish state 1, optionally publish successor state 2, send."""
    manifest = default_manifests(loaded.tensor_contract)["full"]
    fence = await policy.begin_request(request_id)
    call = PrefillCall(
        request_id=request_id, request_generation=fence.request_generation,
        prompt_ids=tuple(needle_ids(loaded, 96, 31)), sampling=SamplingParams(), max_tokens=4,
        manifest_sha256=manifest.sha256, decode=DecodeTarget(stack.decode_addresses[0], "decode-under-test"),
    )
    job = PrefillJob(call, manifest)
    fwd = forward(loaded, job, chunk_size=512)
    packed = Packed.of(compress(manifest, fwd.result, job.identity))
    await publish(policy, job, packed, "e2e-late-prefill")
    if supersede:
        await policy.publish_state(StatePublication(
            request_id=request_id, request_generation=fence.request_generation, parent_state_generation=1,
            state_generation=2, cache_generation=2, receipt_digest="e" * 64, manifest_sha256=manifest.sha256,
            phase=Phase.DECODING,
        ))
    handoff = DecodeHandoff(KVSender("e2e-late-prefill"), "cpu")
    try:
        sent = await handoff.send(call, fwd.first_token, packed, Deadline.after(30))
    finally:
        await handoff.close()
    assert sent.bytes_moved == packed.ledger.traffic_bytes
    return decode_pb2.StreamTokensRequest(request_id=request_id, request_generation=fence.request_generation,
                                          transfer_id=sent.descriptor.transfer_id)


async def test_superseded_state_is_rejected_by_the_decode_worker(stack: UpStack, loaded: LoadedModel) -> None:
    async with PolicyClient(PolicyClientConfig(stack.policy_address, timeout_s=5.0)) as policy, \
            grpc.aio.insecure_channel(stack.decode_addresses[0]) as channel:
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)

        current = await send_state_one(stack, loaded, policy, "e2e-fence-current", supersede=False)
        events = [e async for e in stub.StreamTokens(current, timeout=60)]
        assert events[-1].HasField("summary") and len(events) == 5

        stale = await send_state_one(stack, loaded, policy, "e2e-fence-stale", supersede=True)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [e async for e in stub.StreamTokens(stale, timeout=60)]
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(caught.value)
    assert detail is not None and detail.reason == common_pb2.ERROR_REASON_STALE_GENERATION, caught.value.details()
    assert detail.current.state_generation == 2
