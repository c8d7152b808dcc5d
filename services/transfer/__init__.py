"""KV transfer between prefill and decode workers: descriptors over gRPC, packed rows over
pairwise torch.distributed groups (gloo for CPU tensors, NCCL for CUDA tensors). Descriptors
cross the wire through `services.transfer.codec` only."""

from services.transfer.deadline import Deadline
from services.transfer.descriptor import OffloadRef, PairRoute, TransferDescriptor, ViewHandoff
from services.transfer.errors import (
    DescriptorInvalid,
    PairGroupsExhausted,
    PeerLost,
    PeerUnauthenticated,
    TransferError,
    TransferKey,
    TransferMismatch,
    TransferTimeout,
)
from services.transfer.layout import PackedLayer, TensorSpec, ViewLayout, layer_of
from services.transfer.pairgroup import PairGroupConfig
from services.transfer.receiver import KVReceiver, RecvTransfer
from services.transfer.sender import KVSender, PairLease, SendTransfer
from services.transfer.sidecar import Sidecar, SidecarLayout

__all__ = [
    "Deadline",
    "DescriptorInvalid",
    "KVReceiver",
    "KVSender",
    "OffloadRef",
    "PackedLayer",
    "PairGroupConfig",
    "PairGroupsExhausted",
    "PairLease",
    "PairRoute",
    "PeerLost",
    "PeerUnauthenticated",
    "RecvTransfer",
    "SendTransfer",
    "Sidecar",
    "SidecarLayout",
    "TensorSpec",
    "TransferDescriptor",
    "TransferError",
    "TransferKey",
    "TransferMismatch",
    "TransferTimeout",
    "ViewHandoff",
    "ViewLayout",
    "layer_of",
]
