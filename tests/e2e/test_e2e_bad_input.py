"""Every class of bad input through the real gateway process comes back INVALID_ARGUMENT
naming the field, and the services keep serving: a good request right after succeeds."""

from __future__ import annotations

import math

import grpc
import pytest
from e2e_helpers import UpStack, needle_ids

from services.gateway.client import GatewayClient, generate_request
from services.model import LoadedModel
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(120)
CONTEXT = 4096  # max_position_embeddings of the e2e checkpoint


def bad_requests(vocab: int) -> list[tuple[str, gateway_pb2.GenerateRequest, str]]:
    ok_ids = gateway_pb2.TokenIds(ids=[1, 5, 6])

    def with_sampling(**fields: object) -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(token_ids=ok_ids, sampling=common_pb2.SamplingParams(**{"max_tokens": 4, **fields}))

    return [
        ("no prompt", gateway_pb2.GenerateRequest(), "prompt"),
        ("empty text", gateway_pb2.GenerateRequest(text=""), "text"),
        ("empty ids", gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds()), "token_ids.ids"),
        ("prompt over the model maximum", gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[5] * CONTEXT)),
         "token_ids.ids"),
        ("text over the model maximum", gateway_pb2.GenerateRequest(text="the " * CONTEXT), "text"),
        ("unknown policy", generate_request([1, 5], policy="no-such-policy"), "manifest.by_name.name"),
        ("unknown manifest sha", generate_request([1, 5], manifest_sha256="0" * 64), "manifest.sha256"),
        ("max_tokens 0", with_sampling(max_tokens=0), "sampling.max_tokens"),
        ("max_tokens negative", with_sampling(max_tokens=-1), "sampling.max_tokens"),
        ("max_tokens above the limit", with_sampling(max_tokens=4097), "sampling.max_tokens"),
        ("negative temperature", with_sampling(temperature=-1.0), "sampling.temperature"),
        ("nan temperature", with_sampling(temperature=math.nan), "sampling.temperature"),
        ("top_p above 1", with_sampling(top_p=1.5), "sampling.top_p"),
        ("negative top_k", with_sampling(top_k=-3), "sampling.top_k"),
        ("stop id outside the vocabulary", with_sampling(stop_token_ids=[vocab]), "sampling.stop_token_ids[0]"),
        ("negative token id", gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, -5])), "token_ids.ids[1]"),
        ("token id past the vocabulary", gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[vocab + 7])),
         "token_ids.ids[0]"),
        ("malformed request id", gateway_pb2.GenerateRequest(request_id="no spaces allowed", token_ids=ok_ids), "request_id"),
    ]


def test_bad_input_is_invalid_argument_naming_the_field(stack: UpStack, loaded: LoadedModel) -> None:
    vocab = loaded.config.vocab_size
    with grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for case, request, field in bad_requests(vocab):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, timeout=30))
            error = caught.value
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, error.details())
            detail = dict(error.trailing_metadata()).get("kvrelay-error-bin")
            assert detail is not None, case
            assert common_pb2.ErrorDetail.FromString(detail).field == field, case
    with GatewayClient(stack.gateway_address, timeout_s=60) as client:
        result = client.generate(generate_request(needle_ids(loaded, 48, 5), policy="snapkv", max_tokens=3))
    assert result.summary.output_tokens >= 1 and not stack.dead()
