"""Typed errors of the transfer layer.

Every failure of a transfer carries its `TransferKey`; the gRPC edge maps the classes to
status codes once (`TransferTimeout` -> DEADLINE_EXCEEDED, `PeerLost` -> UNAVAILABLE,
`TransferMismatch` -> FAILED_PRECONDITION, `PairGroupsExhausted` -> RESOURCE_EXHAUSTED,
`DescriptorInvalid` -> INVALID_ARGUMENT).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferKey:
    """What names one transfer on both sides. Both sides read it from the descriptor."""

    request_id: str
    request_generation: int
    state_generation: int
    transfer_id: str

    def __str__(self) -> str:
        return (
            f"{self.request_id}@r{self.request_generation}/s{self.state_generation}"
            f"#{self.transfer_id}"
        )


class DescriptorInvalid(ValueError):
    """A transfer descriptor (or its wire form) is malformed. `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"{field}: {message}")


class TransferError(RuntimeError):
    """A transfer failed. Its pair group has been torn down unless the error says otherwise."""

    def __init__(self, key: TransferKey, message: str) -> None:
        self.key = key
        self.reason = message
        super().__init__(f"transfer {key}: {message}")


class TransferTimeout(TransferError):
    """A rendezvous, send or receive did not finish by its deadline."""


class PeerLost(TransferError):
    """The other worker went away (connection closed, store unreachable, group closed)."""


class PeerUnauthenticated(TransferError):
    """The peer that joined a pair group could not prove it holds the group's secret; the
    group was torn down before any tensor was received."""


class TransferMismatch(TransferError):
    """What was sent or received disagrees with the descriptor. `field` names the part."""

    def __init__(self, key: TransferKey, field: str, message: str) -> None:
        self.field = field
        super().__init__(key, f"{field}: {message}")


class PairGroupsExhausted(TransferError):
    """Every pair-group slot of this worker is busy; nothing was torn down."""
