"""The decode worker's RPC edge: an AcceptTransfer descriptor becomes a `ViewHandoff` through
`services.transfer.codec` (the one parser of it), then what depends on this worker is checked:
token ids against its vocabulary, and `check_sampling` with its `max_new_tokens` (the rule set
the gateway and the prefill worker applied before). Every bad field raises `TransferInvalid`
named from the request (`descriptor.sampling.top_p`, `descriptor.receipt.manifest_sha256`).
"""

from __future__ import annotations

from decode_worker.errors import TransferInvalid
from services.model.errors import InvalidModelInput
from services.model.sampler import SamplingLimits, check_sampling
from services.rpc.kvrelay.v1 import decode_pb2
from services.transfer import DescriptorInvalid, ViewHandoff
from services.transfer.codec import handoff_from_proto

_INT32_MAX = 2**31 - 1


def parse_handoff(
    message: decode_pb2.TransferDescriptor, *, vocab_size: int, max_new_tokens: int
) -> ViewHandoff:
    """Parse and validate a wire descriptor; TransferInvalid names the first bad field."""
    try:
        handoff = handoff_from_proto(message)
    except DescriptorInvalid as exc:
        raise TransferInvalid(exc.reason, field=f"descriptor.{exc.field}") from None
    limits = SamplingLimits(min(vocab_size, _INT32_MAX), max_tokens=max_new_tokens)
    if not handoff.first_token_id < limits.vocab_size:
        reason = f"token id {handoff.first_token_id} is not in [0, {vocab_size})"
        raise TransferInvalid(reason, field="descriptor.first_token_id")
    try:
        check_sampling(handoff.sampling, handoff.max_tokens, limits)
    except InvalidModelInput as exc:
        raise TransferInvalid(exc.reason, field=f"descriptor.{exc.field}") from None
    return handoff
