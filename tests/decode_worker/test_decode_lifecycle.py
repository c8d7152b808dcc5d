"""The per-transfer state machine: every (state, target) pair is either a transition of
`TRANSITIONS` or refused, and the transition that ends a transfer releases what it holds in
the state it ends from (reservation, pair-group receive, decode-loop request, offload lease)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from decode_worker.accept import Accepted
from decode_worker.admit import Decoding
from decode_worker.errors import DuplicateTransfer, ViewRejected
from decode_worker.lifecycle import (
    TERMINAL,
    TRANSITIONS,
    Transfer,
    TransferState,
    TransferStateError,
    TransferTable,
)
from decode_worker.receive import Received
from decode_worker.scheduler import DecodeFailed, DecodeFinished, KVBudget, TokenOut
from decode_worker.verify import Verified
from services.model.sampler import FINISH_LENGTH

S = TransferState
RESERVED = 40


@dataclass
class Held:
    """What a test transfer holds, and what released it."""

    budget: KVBudget = field(default_factory=lambda: KVBudget(100))
    recv_cancels: list[str] = field(default_factory=list)
    lease_releases: int = 0
    loop_cancels: int = 0

    def cancel(self, reason: str) -> None:
        self.recv_cancels.append(reason)

    def release_soon(self) -> None:
        self.lease_releases += 1

    def cancel_in_loop(self) -> None:
        self.loop_cancels += 1


def new_transfer(held: Held, transfer_id: str = "t-1") -> Transfer:
    descriptor = SimpleNamespace(transfer_id=transfer_id, request_id="req", request_generation=1)
    accepted = Accepted(
        handoff=cast(Any, SimpleNamespace(descriptor=descriptor)),
        deadline=cast(Any, None),
        reservation=held.budget.reserve(RESERVED, transfer_id),
        recv=cast(Any, held),
        lease=cast(Any, held),
        trace_parent=cast(Any, None),
    )
    return Transfer(accepted)


def decoding(held: Held) -> Decoding:
    return Decoding(asyncio.Queue(), None, held.cancel_in_loop)


FINISHED = DecodeFinished(FINISH_LENGTH, 4, 5, 1.0)
# The verb that asks for each target state.
MOVES: dict[TransferState, Callable[[Transfer, Held], None]] = {
    S.RECEIVED: lambda t, h: t.receive(cast(Any, Received)(None, None, 0)),
    S.VERIFIED: lambda t, h: t.verify(cast(Any, Verified)(None, None)),
    S.DECODING: lambda t, h: t.decode(decoding(h)),
    S.FINISHED: lambda t, h: t.deliver(FINISHED),
    S.FAILED: lambda t, h: t.fail(ViewRejected("forged", field="receipt.digest")),
}
PATH = (S.RECEIVED, S.VERIFIED, S.DECODING)


def transfer_at(state: TransferState, held: Held) -> Transfer:
    """A transfer driven to `state` through the verbs the stages use (an ended one by way of
    the decode loop, the longest path)."""
    transfer = new_transfer(held)
    path: tuple[TransferState, ...] = ()
    if state in TERMINAL:
        path = (*PATH, state)
    elif state in PATH:
        path = PATH[: PATH.index(state) + 1]
    for step in path:
        MOVES[step](transfer, held)
    assert transfer.state is state
    return transfer


def test_the_machine_is_the_documented_one() -> None:
    assert dict(TRANSITIONS) == {
        S.ACCEPTED: {S.RECEIVED, S.FAILED},
        S.RECEIVED: {S.VERIFIED, S.FAILED},
        S.VERIFIED: {S.DECODING, S.FAILED},
        S.DECODING: {S.FINISHED, S.FAILED},
        S.FINISHED: set(),
        S.FAILED: set(),
    }
    assert {S.FINISHED, S.FAILED} == TERMINAL


TARGETS = [state for state in S if state is not S.ACCEPTED]  # no verb goes back to accepted


@pytest.mark.parametrize(("source", "target"), list(itertools.product(S, TARGETS)))
def test_every_pair_is_a_transition_or_refused(source: TransferState, target: TransferState) -> None:
    held = Held()
    transfer = transfer_at(source, held)
    if target in TRANSITIONS[source]:
        MOVES[target](transfer, held)
        assert transfer.state is target
    elif source in TERMINAL and target is S.FINISHED:
        # A decode-loop end that arrives after this side ended the transfer is only queued.
        MOVES[target](transfer, held)
        assert transfer.state is source
    else:
        with pytest.raises(TransferStateError):
            MOVES[target](transfer, held)
        assert transfer.state is source


@pytest.mark.parametrize("source", [S.ACCEPTED, S.RECEIVED, S.VERIFIED])
def test_a_failure_before_decoding_releases_reservation_receive_and_lease(
    source: TransferState,
) -> None:
    held = Held()
    transfer = transfer_at(source, held)
    assert held.budget.used_bytes == RESERVED
    transfer.fail(ViewRejected("forged", field="receipt.digest"))
    assert held.budget.used_bytes == 0
    assert held.recv_cancels == ["receipt.digest: forged"]
    assert (held.lease_releases, held.loop_cancels) == (1, 0)
    assert isinstance(transfer.failure, ViewRejected)


def test_abandoning_a_decoding_transfer_cancels_it_in_the_decode_loop() -> None:
    held = Held()
    transfer = transfer_at(S.DECODING, held)
    transfer.close("stream closed")
    transfer.close("stream ended")  # idempotent
    assert transfer.state is S.FAILED
    assert (held.loop_cancels, held.lease_releases, held.recv_cancels) == (1, 1, [])
    # The reservation is the decode loop's now: its cancel releases it, not this side.
    assert held.budget.used_bytes == RESERVED


@pytest.mark.parametrize("last", [FINISHED, DecodeFailed("recall failed")])
def test_the_decode_loops_end_releases_the_lease_and_every_event_is_queued(last: object) -> None:
    held = Held()
    transfer = transfer_at(S.DECODING, held)
    token = TokenOut(7, 1, -0.5)
    transfer.deliver(token)
    assert transfer.state is S.DECODING
    transfer.deliver(cast(Any, last))
    assert transfer.state is (S.FINISHED if last is FINISHED else S.FAILED)
    transfer.close("stream ended")
    assert (held.lease_releases, held.loop_cancels, held.recv_cancels) == (1, 0, [])
    queue = transfer.decoding.events  # type: ignore[union-attr]
    assert [queue.get_nowait(), queue.get_nowait()] == [token, last]


def test_reading_a_stage_product_before_the_stage_ran_is_an_internal_error() -> None:
    transfer = transfer_at(S.ACCEPTED, Held())
    with pytest.raises(TransferStateError):
        _ = transfer.received
    with pytest.raises(TransferStateError):
        transfer.deliver(FINISHED)


def test_the_table_refuses_an_id_being_accepted_or_open() -> None:
    table, held = TransferTable(), Held()
    with table.claim("t-1"):
        assert len(table) == 1
        with pytest.raises(DuplicateTransfer), table.claim("t-1"):
            pass
        transfer = table.add(new_transfer(held))
    with pytest.raises(DuplicateTransfer), table.claim("t-1"):
        pass
    assert table.get("t-1") is transfer and len(table) == 1
    assert table.remove(transfer) and not table.remove(transfer) and len(table) == 0
