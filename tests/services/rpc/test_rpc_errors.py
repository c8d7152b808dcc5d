"""`status_for`: the one mapping from typed errors to gRPC status, for the errors that are not
`ServiceError`s themselves (the kvpolicy core's and the model runtime's)."""

from __future__ import annotations

import grpc

from services.kvpolicy.errors import ManifestInvalid
from services.kvpolicy.head_profile import HeadProfileUnavailable
from services.model.errors import NonFiniteLogits
from services.rpc.errors import status_for


def test_a_non_finite_first_token_is_internal_and_names_the_logits() -> None:
    status = status_for(NonFiniteLogits((0,)))
    assert status is not None and status.code is grpc.StatusCode.INTERNAL
    assert status.detail.field == "logits" and "not finite" in status.detail.message


def test_a_missing_head_profile_is_a_failed_precondition() -> None:
    status = status_for(HeadProfileUnavailable("no profile abc"))
    assert status is not None and status.code is grpc.StatusCode.FAILED_PRECONDITION
    assert status.detail.field == "selection.allocation.headkv_profile_sha256"


def test_policy_errors_are_invalid_argument_naming_the_field() -> None:
    status = status_for(ManifestInvalid("tensor.head_dim", "must be positive"))
    assert status is not None and status.code is grpc.StatusCode.INVALID_ARGUMENT
    assert status.detail.field == "tensor.head_dim"


def test_unknown_errors_are_left_to_grpc() -> None:
    assert status_for(RuntimeError("boom")) is None
