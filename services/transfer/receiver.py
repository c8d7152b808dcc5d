"""Decode side of a transfer: host the rendezvous store, receive packed views layer by layer.

    receiver = KVReceiver(config, device)                     # receiver.address -> senders
    transfer = receiver.start_recv(handoff.descriptor, deadline)  # in AcceptTransfer
    first = transfer.wait_for_layer(0, deadline)              # usable before the rest arrives
    view = transfer.wait_for_view(deadline)                   # -> PackedKVView
    sidecar = transfer.wait_for_sidecar(deadline)             # -> Sidecar | None

Receives are posted as soon as the pair group is connected, straight into the buffers of
the final view (no copies). Every layer is checked against the descriptor before it is
handed out, and the whole view is validated before `wait_for_view` returns it. A failure
tears the pair group down and raises a typed error carrying the transfer key.
"""

from __future__ import annotations

import hmac
import threading

import torch
import torch.distributed as dist

from services.kvpolicy.errors import PackingError
from services.kvpolicy.packing import OFFSET_DTYPE, POSITION_DTYPE, PackedKVView
from services.transfer.deadline import Deadline
from services.transfer.descriptor import TransferDescriptor
from services.transfer.errors import PeerLost, TransferError, TransferMismatch
from services.transfer.layout import PackedLayer, ViewLayout, check_layer
from services.transfer.pairgroup import (
    RECEIVER_RANK,
    GroupId,
    PairGroup,
    PairGroupConfig,
    PairGroupPool,
    RendezvousHost,
    backend_available,
    backend_for,
    wire_tag,
)
from services.transfer.sidecar import Sidecar, allocate_sidecar, sidecar_from_buffers, sidecar_tag


class KVReceiver:
    """A decode worker's receiving side: its rendezvous store and its pair groups."""

    def __init__(self, config: PairGroupConfig | None = None, device: torch.device | str = "cpu") -> None:
        self.config = config or PairGroupConfig()
        self.device = torch.device(device)
        self._host = RendezvousHost(self.config.bind_host, self.config.store_port)
        self._pool = PairGroupPool(self.config, on_close=self._forget, side="receiver")
        self._admit_lock = threading.Lock()

    @property
    def address(self) -> str:
        """"host:port" of the rendezvous store that senders connect to."""
        return self._host.address

    def start_recv(self, descriptor: TransferDescriptor, deadline: Deadline) -> RecvTransfer:
        """Begin receiving the view a descriptor announces. Joins (or reuses) the pair group
        it names; connecting runs in the background and gives up at `deadline`."""
        key, route = descriptor.key, descriptor.route
        if route.store_address != self.address:
            raise TransferMismatch(key, "rendezvous_address", f"{route.store_address} is not this worker ({self.address})")
        if route.backend != backend_for(self.device) or not backend_available(route.backend):
            raise TransferMismatch(key, "rendezvous_address.backend", f"{route.backend} cannot receive on {self.device}")
        group_id = GroupId(descriptor.source_worker, route.backend, route.epoch)
        self._pool.sweep()
        with self._admit_lock:
            group = self._pool.acquire(group_id)
            if group is None:
                group = self._open(group_id, descriptor, deadline)
        if not hmac.compare_digest(group.secret, route.secret):
            # Refused, not torn down: the group itself is sound, and is still the sender's.
            self._pool.release(group)
            reason = f"is not the key of pair group {group_id}"
            raise TransferMismatch(key, "rendezvous_secret", reason)
        return RecvTransfer(descriptor, group, self._pool, self.device)

    def sweep(self) -> list[GroupId]:
        """Close idle groups past the idle timeout (also done on every `start_recv`)."""
        return self._pool.sweep()

    def group_ids(self) -> list[GroupId]:
        return self._pool.group_ids()

    def close(self) -> None:
        self._pool.close_all("receiver closed")

    def _open(self, group_id: GroupId, descriptor: TransferDescriptor, deadline: Deadline) -> PairGroup:
        if self._pool.was_closed(group_id):
            raise PeerLost(descriptor.key, f"pair group {group_id} was already closed here")
        secret = descriptor.route.secret
        group = PairGroup(group_id, RECEIVER_RANK, self.address, self.device, self.config.bind_host, secret)
        self._pool.admit(group, descriptor.key)
        self._host.store.set(group_id.open_key, "1")
        group.start_rendezvous(deadline)
        return group

    def _forget(self, group: PairGroup) -> None:
        # Synchronous (the store is local), so a sender never reuses a group closed here.
        self._host.store.delete_key(group.id.open_key)


class RecvTransfer:
    """One packed view on its way in: `wait_for_layer` per layer or `wait_for_view`."""

    def __init__(
        self, descriptor: TransferDescriptor, group: PairGroup, pool: PairGroupPool, device: torch.device
    ) -> None:
        self.descriptor = descriptor
        self.bytes_moved = 0
        self._key = descriptor.key
        self._group = group
        self._pool = pool
        self._buffers = _allocate(descriptor.layout, device)
        self._layers = [_layer_view(self._buffers, descriptor.layout, layer) for layer in range(descriptor.layout.num_layers)]
        self._works: list[list[dist.Work]] = [[] for _ in self._layers]
        layout = descriptor.sidecar
        self._sidecar_buffers = allocate_sidecar(layout, device) if layout is not None else {}
        self._sidecar_works: list[dist.Work] = []
        self._sidecar: Sidecar | None = None
        self._lock = threading.Lock()
        self._posted = False
        self._done: set[int] = set()
        self._error: TransferError | None = None
        group.when_ready(self._post_all)

    def wait_for_layer(self, layer: int, deadline: Deadline) -> PackedLayer:
        """Block until `layer` has arrived and matches the descriptor; returns it (views into
        the final view's buffers)."""
        if not 0 <= layer < len(self._layers):
            raise TransferMismatch(self._key, "layer", f"{layer} outside [0, {len(self._layers)})")
        if self._error is not None:
            raise self._error
        if layer not in self._done:
            self._receive(layer, deadline)
        return self._layers[layer]

    def wait_for_view(self, deadline: Deadline) -> PackedKVView:
        """Block until every layer has arrived; returns the validated view."""
        for layer in range(len(self._layers)):
            self.wait_for_layer(layer, deadline)
        buffers = self._buffers
        try:
            return PackedKVView(
                packed_k=buffers["packed_k"],
                packed_v=buffers["packed_v"],
                original_position_map=buffers["original_position_map"].cpu(),
                row_offsets=buffers["row_offsets"].cpu(),
            )
        except PackingError as exc:
            raise TransferMismatch(self._key, exc.field, exc.reason) from exc

    def wait_for_sidecar(self, deadline: Deadline) -> Sidecar | None:
        """Block until the page summaries (and host-tier rows) have arrived; None when the
        descriptor announces no sidecar. They are validated and in host memory."""
        layout = self.descriptor.sidecar
        if layout is None:
            return None
        if self._error is not None:
            raise self._error
        if self._sidecar is None:
            try:
                self._group.wait_ready(deadline, self._key)
                self._post_all()
                if self._error is not None:
                    raise self._error
                for work in self._sidecar_works:
                    self._group.wait(work, deadline, self._key)
                self._sidecar = sidecar_from_buffers(layout, self._sidecar_buffers, self._key)
            except TransferError as exc:
                self._fail(exc)
                raise
            self.bytes_moved += layout.nbytes
            self._release_when_done()
        return self._sidecar

    def cancel(self, reason: str) -> None:
        """Abandon the transfer; if anything is still in flight the pair group is torn down."""
        if self._error is None and not self._complete:
            self._fail(PeerLost(self._key, f"cancelled: {reason}"))

    @property
    def _complete(self) -> bool:
        sidecar_done = self.descriptor.sidecar is None or self._sidecar is not None
        return len(self._done) == len(self._layers) and sidecar_done

    def _receive(self, layer: int, deadline: Deadline) -> None:
        try:
            self._group.wait_ready(deadline, self._key)
            self._post_all()
            if self._error is not None:
                raise self._error
            for work in self._works[layer]:
                self._group.wait(work, deadline, self._key)
            check_layer(self.descriptor.layout, self._layers[layer], self._key)
        except TransferError as exc:
            self._fail(exc)
            raise
        self._done.add(layer)
        self.bytes_moved += self._layers[layer].nbytes
        self._release_when_done()

    def _release_when_done(self) -> None:
        if self._complete:
            self._pool.release(self._group)

    def _post_all(self) -> None:
        # Runs once, in the rendezvous thread or the first waiter, whichever comes first.
        with self._lock:
            if self._posted:
                return
            self._posted = True
            try:
                for layer in self._layers:
                    self._works[layer.layer] = [
                        self._group.post_recv(tensor, wire_tag(layer.layer, field), self._key)
                        for field, tensor in enumerate(layer.wire_tensors())
                        if tensor.numel() > 0
                    ]
                self._sidecar_works = [
                    self._group.post_recv(tensor, sidecar_tag(name), self._key)
                    for name, tensor in self._sidecar_buffers.items()
                    if tensor.numel() > 0
                ]
            except TransferError as exc:
                self._error = exc

    def _fail(self, error: TransferError) -> None:
        self._error = error
        self._pool.discard(self._group, str(error))


def _allocate(layout: ViewLayout, device: torch.device) -> dict[str, torch.Tensor]:
    # Metadata travels on the payload's device too (NCCL moves only CUDA tensors); the
    # returned view keeps it on the CPU, where `pack` puts it.
    rows, head_dim = layout.total_rows, layout.head_dim
    return {
        "packed_k": torch.empty(rows, head_dim, dtype=layout.k_dtype, device=device),  # [R_total, d_h]
        "packed_v": torch.empty(rows, head_dim, dtype=layout.v_dtype, device=device),  # [R_total, d_h]
        "original_position_map": torch.empty(rows, dtype=POSITION_DTYPE, device=device),  # [R_total]
        "row_offsets": torch.empty(layout.num_layers, layout.num_owners + 1, dtype=OFFSET_DTYPE, device=device),  # [L, H + 1]
    }


def _layer_view(buffers: dict[str, torch.Tensor], layout: ViewLayout, layer: int) -> PackedLayer:
    start = layout.layer_start(layer)
    rows = slice(start, start + layout.layer_rows[layer])
    return PackedLayer(
        layer=layer,
        row_offsets=buffers["row_offsets"][layer],
        original_position_map=buffers["original_position_map"][rows],
        packed_k=buffers["packed_k"][rows],
        packed_v=buffers["packed_v"][rows],
    )
