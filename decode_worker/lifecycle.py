"""The life of one accepted transfer, as an explicit state machine.

    accepted ──▶ received ──▶ verified ──▶ decoding ──▶ finished
        │            │            │            │
        └────────────┴────────────┴────────────┴──────▶ failed

`Transfer` is the one mutable object per transfer. Each stage hands it the frozen product it
made — `Accepted` (accept.py), `Received` (receive.py), `Verified` (verify.py), `Decoding`
(admit.py) — with the transition that goes with it; a transition not in `TRANSITIONS`
raises `IllegalTransition` (a bug here, never bad input). What a transfer holds is released
by the transition that ends it, so no failure path can forget a resource:

    failed, from before decoding   the reservation and the pair-group receive (`Accepted.release`)
    failed, while decoding         its request in the decode loop (`Decoding.cancel`), which
                                   frees the KV and the reservation
    finished or failed             the offload lease (recallable_remote)

The decode loop's own end of a request (finished, or failed) arrives as its last event
(`deliver`); an end this side decided (`fail`, `close`) comes first when both race, and the
loop's late event is still queued for a stream that reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import TypeVar

from decode_worker.accept import Accepted
from decode_worker.admit import Decoding
from decode_worker.errors import DuplicateTransfer, TransferFailed
from decode_worker.receive import Received
from decode_worker.scheduler import DecodeEvent, DecodeFailed, DecodeFinished
from decode_worker.verify import Verified
from services.rpc.errors import ServiceError


class TransferState(StrEnum):
    """Where one accepted transfer is."""

    ACCEPTED = "accepted"  # reservation held, receives posted
    RECEIVED = "received"  # the view and its sidecar arrived
    VERIFIED = "verified"  # manifest, view, receipt, offload and fence checked
    DECODING = "decoding"  # in the decode loop, which now holds the reservation
    FINISHED = "finished"  # the decode loop ended it (eos, stop, length or cancelled)
    FAILED = "failed"  # rejected, abandoned, or failed while decoding


_T = TypeVar("_T")
_S = TransferState
TRANSITIONS: Mapping[TransferState, frozenset[TransferState]] = MappingProxyType({
    _S.ACCEPTED: frozenset({_S.RECEIVED, _S.FAILED}),
    _S.RECEIVED: frozenset({_S.VERIFIED, _S.FAILED}),
    _S.VERIFIED: frozenset({_S.DECODING, _S.FAILED}),
    _S.DECODING: frozenset({_S.FINISHED, _S.FAILED}),
    _S.FINISHED: frozenset(),
    _S.FAILED: frozenset(),
})
TERMINAL = frozenset(state for state, targets in TRANSITIONS.items() if not targets)


class TransferStateError(RuntimeError):
    """The lifecycle was used against its state machine: an internal error, never input."""


class IllegalTransition(TransferStateError):
    """A transfer was asked to move where its state machine does not go."""

    def __init__(self, transfer_id: str, current: TransferState, target: TransferState) -> None:
        move = f"{current.value} → {target.value}"
        super().__init__(f"transfer {transfer_id}: {move} is not a transition")
        self.current = current
        self.target = target


class Transfer:
    """One accepted transfer's lifecycle (event-loop confined). `stream_open` says whether
    StreamTokens has opened it; `tasks` are the background stages that close cancels;
    `failure` is the error that ended it before it reached the decode loop, or that
    abandoned it there."""

    def __init__(self, accepted: Accepted) -> None:
        self.accepted = accepted
        self.state = TransferState.ACCEPTED
        self.stream_open = False
        self.tasks: list[asyncio.Task[None]] = []
        self.failure: ServiceError | None = None
        self._received: Received | None = None
        self._verified: Verified | None = None
        self._decoding: Decoding | None = None
        self._settled = asyncio.Event()  # decoding, or failed

    @property
    def transfer_id(self) -> str:
        return self.accepted.transfer_id

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def received(self) -> Received:
        return _produced(self._received, self, TransferState.RECEIVED)

    @property
    def verified(self) -> Verified:
        return _produced(self._verified, self, TransferState.VERIFIED)

    @property
    def decoding(self) -> Decoding | None:
        """The decode loop's side, once the transfer reached it (None before)."""
        return self._decoding

    def receive(self, received: Received) -> None:
        self._move(TransferState.RECEIVED)
        self._received = received

    def verify(self, verified: Verified) -> None:
        self._move(TransferState.VERIFIED)
        self._verified = verified

    def decode(self, decoding: Decoding) -> None:
        self._move(TransferState.DECODING)
        self._decoding = decoding
        self._settled.set()

    def deliver(self, event: DecodeEvent) -> None:
        """An event of the decode loop; its last one ends the transfer unless it has ended."""
        decoding = _produced(self._decoding, self, TransferState.DECODING)
        if isinstance(event, DecodeFinished | DecodeFailed) and not self.terminal:
            finished = isinstance(event, DecodeFinished)
            self._move(TransferState.FINISHED if finished else TransferState.FAILED)
            self._release_lease()
        decoding.events.put_nowait(event)

    def fail(self, error: ServiceError) -> None:
        """End the transfer with `error`, releasing what it holds in its current state."""
        self._move(TransferState.FAILED)
        self.failure = error
        if self._decoding is not None:
            self._decoding.cancel()
        else:
            self.accepted.release(str(error))
        self._release_lease()
        self._settled.set()

    def close(self, reason: str) -> None:
        """Abandon the transfer (idempotent): fail it unless it has ended already."""
        if not self.terminal:
            self.fail(TransferFailed(reason, field="transfer"))

    async def settled(self) -> None:
        """Wait until the transfer is decoding or has failed (verification is behind it)."""
        await self._settled.wait()

    def _move(self, target: TransferState) -> None:
        if target not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.transfer_id, self.state, target)
        self.state = target

    def _release_lease(self) -> None:
        if self.accepted.lease is not None:
            self.accepted.lease.release_soon()


class TransferTable:
    """A worker's open transfers by id (event-loop confined). An id is claimed while its
    AcceptTransfer is under way, so a duplicate is refused even before it is accepted."""

    def __init__(self) -> None:
        self._open: dict[str, Transfer] = {}
        self._claimed: set[str] = set()

    def __len__(self) -> int:
        return len(self._open) + len(self._claimed)

    @contextlib.contextmanager
    def claim(self, transfer_id: str) -> Iterator[None]:
        """Hold `transfer_id` while it is being accepted; DuplicateTransfer if it is taken."""
        if transfer_id in self._open or transfer_id in self._claimed:
            raise DuplicateTransfer("is already accepted", field="descriptor.transfer_id")
        self._claimed.add(transfer_id)
        try:
            yield
        finally:
            self._claimed.discard(transfer_id)

    def add(self, transfer: Transfer) -> Transfer:
        self._open[transfer.transfer_id] = transfer
        return transfer

    def get(self, transfer_id: str) -> Transfer | None:
        return self._open.get(transfer_id)

    def remove(self, transfer: Transfer) -> bool:
        """Forget `transfer`; False if it was not open (closed already)."""
        if self._open.get(transfer.transfer_id) is not transfer:
            return False
        del self._open[transfer.transfer_id]
        return True

    def all(self) -> list[Transfer]:
        return list(self._open.values())


def _produced(product: _T | None, transfer: Transfer, stage: TransferState) -> _T:
    """What a stage produced, read after it ran; reading it earlier is a bug here."""
    if product is None:
        where = f"is {transfer.state.value}, not {stage.value}"
        raise TransferStateError(f"transfer {transfer.transfer_id} {where}")
    return product
