"""Pairwise process groups between one prefill worker (sender, rank 0) and one decode worker
(receiver, rank 1).

Groups are created lazily, one rendezvous per (sender, backend, epoch) through the TCPStore
that the decode worker hosts (`RendezvousHost`), under a `PrefixStore` named by the group.
The backend is constructed directly (`ProcessGroupGloo` for CPU tensors, `ProcessGroupNCCL`
for CUDA tensors) and never registered as a default group, so workers join and leave freely.

A group carries one sending transfer at a time; concurrent transfers between the same pair
use more groups. Because the sender finishes a transfer only after the receiver posted the
matching receives, successive transfers on a group are matched in order on both sides, and
message tags only need to tell the messages of one transfer apart (`wire_tag`).

The receiver marks a group usable with an "open" key in its store and deletes it when it
closes the group; a sender checks the key before reusing an idle group, so an eviction on
the decode side is noticed before a descriptor names a dead group. (A sender's own close
reaches the receiver as a closed connection; the receiver's group then idles out.)

Security. The store binds only the decode worker's configured host (`RendezvousHost`), but
anyone who reaches it can list, read and write every key, so store keys are not secret and
nothing secret goes into the store. Each group has a key instead (`PairRoute.secret`): the
sender draws it with the epoch and it reaches the decode worker inside the descriptor, over
gRPC. Right after the backend connects, before a group is ready, both ranks exchange fresh
nonces and then HMAC-SHA256 proofs over the group id, the prover's rank and both nonces, on
the group's own connection (`_authenticate`). A peer without the key is torn down with
`PeerUnauthenticated`; receives of a transfer are posted only on a ready group, so no tensor
from it is ever received, and no tensor is sent to it. A stranger can still disrupt a
rendezvous it finds in the store (the transfer then fails cleanly), but cannot join a group.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.telemetry import metrics
from services.transfer.deadline import Deadline
from services.transfer.errors import (
    PairGroupsExhausted,
    PeerLost,
    PeerUnauthenticated,
    TransferError,
    TransferKey,
    TransferTimeout,
)
from services.transfer.layout import WIRE_FIELDS

CommBackend = Any  # a ProcessGroupGloo or ProcessGroupNCCL, constructed directly

SENDER_RANK = 0
RECEIVER_RANK = 1
_WORLD_SIZE = 2
# A receive that is never matched; its 1 ms timeout is how a gloo group is torn down.
_TEARDOWN_TAG = 2**31 - 1
_TEARDOWN_WAIT = datetime.timedelta(milliseconds=1)
# The two messages of the handshake that authenticates a group (distinct from every
# transfer's tags, which stay below the sidecar's few tags above MAX_LAYERS * fields).
_NONCE_TAG = 2**31 - 3
_PROOF_TAG = 2**31 - 2
_NONCE_BYTES = 32
_AUTH_CONTEXT = b"kvrelay/pair-auth/v1"
_LISTEN_BACKLOG = 128
# gloo rounds timeouts to milliseconds, so a wait can give up just before its deadline.
_TIMEOUT_SLACK_S = 0.05
_CLOSED_MEMORY = 4096
_HOST_STORE_TIMEOUT = datetime.timedelta(seconds=30)


def backend_for(device: torch.device | str) -> str:
    """`nccl` for CUDA tensors, `gloo` for everything else: the one backend decision."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def backend_available(backend: str) -> bool:
    return dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()


def wire_tag(layer: int, field: int) -> int:
    """Tag of one message of a transfer: field `field` (see `WIRE_FIELDS`) of `layer`."""
    return layer * len(WIRE_FIELDS) + field


def new_epoch() -> int:
    """A fresh, random group epoch (positive int64)."""
    return secrets.randbelow(2**62) + 1


def new_secret() -> str:
    """A fresh pair-group key: 32 random bytes as 64 lowercase hex digits."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class PairGroupConfig:
    """Per-worker limits of the transfer layer.

    `bind_host` is the address this worker's gloo transport listens on and advertises to
    its peers (and, on a decode worker, where the rendezvous store is reached); in a
    cluster, the pod IP. `store_port` is the decode worker's rendezvous port (0: any free
    port). A decode worker's `idle_timeout_s` should not be shorter than its senders'.
    """

    max_groups: int = 8
    idle_timeout_s: float = 120.0
    bind_host: str = "127.0.0.1"
    store_port: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_groups, bool) or not isinstance(self.max_groups, int) or self.max_groups < 1:
            raise ValueError(f"max_groups: must be a positive int, got {self.max_groups!r}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s: must be > 0, got {self.idle_timeout_s!r}")
        if not self.bind_host:
            raise ValueError("bind_host: must not be empty")
        if not 0 <= self.store_port < 65536:
            raise ValueError(f"store_port: must be in [0, 65536), got {self.store_port!r}")


@dataclass(frozen=True)
class GroupId:
    """Names one pair group on both workers (the decode worker is implied by its store)."""

    sender: str
    backend: str
    epoch: int

    @property
    def prefix(self) -> str:
        """PrefixStore under which this group's rendezvous keys live."""
        return f"kvrelay/pair/{self.sender}/{self.backend}/{self.epoch}"

    @property
    def open_key(self) -> str:
        """Present in the decode worker's store while the receiver holds the group."""
        return f"kvrelay/open/{self.sender}/{self.backend}/{self.epoch}"

    def __str__(self) -> str:
        return f"{self.sender}/{self.backend}/{self.epoch}"


class RendezvousHost:
    """The decode worker's TCPStore. Every pair group's rendezvous meets here; the store
    does not wait for workers, so senders come and go.

    It listens on `host` only. TCPStore's own server binds every interface whatever host it
    is given (torch 2.13 has no bind-address option), so the listening socket is made here,
    bound to `host`, and handed over through `master_listen_fd`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        listener = _listen(host, port)
        bound_port = listener.getsockname()[1]
        # The store owns the descriptor from here on (it closes it), so Python lets go of it.
        self.store = dist.TCPStore(
            host,
            bound_port,
            is_master=True,
            wait_for_workers=False,
            timeout=_HOST_STORE_TIMEOUT,
            master_listen_fd=listener.detach(),
        )
        self.address = f"{host}:{self.store.port}"


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port` (port 0: any free one), first address of host."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(_LISTEN_BACKLOG)
    except OSError:
        listener.close()
        raise
    return listener


def connect_store(address: str, deadline: Deadline) -> dist.TCPStore:
    """A client of the store at "host:port"; connecting gives up at the deadline."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=deadline.timedelta())


class PairGroup:
    """One two-rank process group. It connects in a background thread (`start_rendezvous`)
    so that neither side's start verb blocks on the other; every wait takes a deadline.
    `secret` is the group's key (`PairRoute.secret`); the group is ready only once the peer
    proved it holds the same key."""

    def __init__(
        self,
        group_id: GroupId,
        rank: int,
        store_address: str,
        device: torch.device,
        bind_host: str,
        secret: str,
    ) -> None:
        self.id = group_id
        self.secret = secret
        self.rank = rank
        self.peer_rank = 1 - rank
        self.store_address = store_address
        self.device = _concrete(device)
        self.bind_host = bind_host
        self._ready: Future[None] = Future()
        self._lock = threading.Lock()
        self._started = False
        self._backend: CommBackend | None = None
        self._store: dist.Store | None = None
        self.closed_reason: str | None = None
        self.auth_s: float | None = None  # seconds the key handshake took, once connected
        # Bookkeeping of the owning pool, guarded by the pool's lock.
        self.users = 0
        self.last_used = 0.0

    @property
    def ready(self) -> bool:
        return self._ready.done() and self._ready.exception() is None

    def start_rendezvous(self, deadline: Deadline) -> None:
        """Start connecting to the peer (idempotent); it gives up at `deadline`."""
        with self._lock:
            if self._started:
                return
            self._started = True
        thread = threading.Thread(target=self._rendezvous, args=(deadline,), daemon=True, name=f"rdv-{self.id}")
        thread.start()

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Run `callback` once connected (now, if already); never if the rendezvous fails."""

        def _on_done(future: Future[None]) -> None:
            if future.exception() is None:
                callback()

        self._ready.add_done_callback(_on_done)

    def wait_ready(self, deadline: Deadline, key: TransferKey) -> None:
        """Block until connected; TransferTimeout or PeerLost otherwise."""
        try:
            self._ready.result(timeout=deadline.remaining())
        except FutureTimeout:
            raise TransferTimeout(key, f"rendezvous of pair group {self.id} not done by the deadline") from None
        except Exception as exc:
            raise self._translate(exc, deadline, key, "rendezvous") from exc

    def post_send(self, tensor: torch.Tensor, tag: int, key: TransferKey) -> dist.Work:
        """Start sending `tensor` to the peer (returns at once)."""
        try:
            return self._connected().send([tensor], self.peer_rank, tag)
        except RuntimeError as exc:
            raise self._translate(exc, None, key, "send") from exc

    def post_recv(self, tensor: torch.Tensor, tag: int, key: TransferKey) -> dist.Work:
        """Start receiving into `tensor` from the peer (returns at once)."""
        try:
            return self._connected().recv([tensor], self.peer_rank, tag)
        except RuntimeError as exc:
            raise self._translate(exc, None, key, "recv") from exc

    def wait(self, work: dist.Work, deadline: Deadline, key: TransferKey) -> None:
        """Block until `work` completes; TransferTimeout at the deadline, PeerLost on error."""
        try:
            _wait_backend(work, self.id.backend, deadline)
        except RuntimeError as exc:
            raise self._translate(exc, deadline, key, "wait") from exc

    def close(self, reason: str) -> None:
        """Tear the group down: pending operations here fail, and the peer sees its
        connection close. Idempotent; a group still connecting is torn down when it connects."""
        with self._lock:
            if self.closed_reason is not None:
                return
            self.closed_reason = reason
            backend, self._backend, self._store = self._backend, None, None
        if backend is not None:
            _teardown(backend, self.id.backend, self.peer_rank)
        self._settle(RuntimeError("closed while connecting"))  # release waiters now

    def _rendezvous(self, deadline: Deadline) -> None:
        try:
            store = connect_store(self.store_address, deadline)
            backend = _connect(dist.PrefixStore(self.id.prefix, store), self.rank, self, deadline)
        except Exception as exc:  # noqa: BLE001 - any failure surfaces through wait_ready
            self._settle(exc)
            return
        try:
            started = time.perf_counter()
            _authenticate(backend, self, deadline)
            self.auth_s = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - any failure surfaces through wait_ready
            _teardown(backend, self.id.backend, self.peer_rank)
            self._settle(exc)
            return
        with self._lock:
            closed = self.closed_reason is not None
            if not closed:
                self._backend, self._store = backend, store
        if closed:
            _teardown(backend, self.id.backend, self.peer_rank)
            self._settle(RuntimeError("closed while connecting"))
            return
        with contextlib.suppress(InvalidStateError):  # a close may have settled it already
            self._ready.set_result(None)

    def _settle(self, error: Exception) -> None:
        """Fail the rendezvous unless it already finished (close and connect may race)."""
        with contextlib.suppress(InvalidStateError):
            self._ready.set_exception(error)

    def _connected(self) -> CommBackend:
        with self._lock:
            if self._backend is None:
                raise RuntimeError(f"pair group {self.id} is not connected")
            return self._backend

    def _translate(self, exc: BaseException, deadline: Deadline | None, key: TransferKey, what: str) -> TransferError:
        if isinstance(exc, _Unauthenticated):
            return PeerUnauthenticated(key, f"{what}: pair group {self.id}: {exc}")
        if self.closed_reason is not None:
            return PeerLost(key, f"{what}: pair group {self.id} was closed ({self.closed_reason})")
        timed_out = "timed out" in str(exc).lower() or (
            deadline is not None and deadline.remaining() < _TIMEOUT_SLACK_S
        )
        if timed_out:
            return TransferTimeout(key, f"{what} on pair group {self.id} not done by the deadline: {exc}")
        return PeerLost(key, f"{what} on pair group {self.id}: {exc}")


def _concrete(device: torch.device) -> torch.device:
    """NCCL binds a communicator to one GPU: "cuda" means the current one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _connect(store: dist.Store, rank: int, group: PairGroup, deadline: Deadline) -> CommBackend:
    """Construct the backend; both ranks block here until they meet or the deadline passes."""
    if group.id.backend == "gloo":
        # The private options are the only per-group way to pick the interface gloo binds
        # (the public constructor reads GLOO_SOCKET_IFNAME for the whole process).
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = deadline.timedelta()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=group.bind_host)]
        return dist.ProcessGroupGloo(store, rank, _WORLD_SIZE, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = deadline.timedelta()
    backend = dist.ProcessGroupNCCL(store, rank, _WORLD_SIZE, options)
    backend.eager_connect_single_device(group.device)  # connect now, under the deadline
    return backend


class _Unauthenticated(RuntimeError):
    """The peer's proof did not verify (becomes `PeerUnauthenticated` with the key)."""


def _authenticate(backend: CommBackend, group: PairGroup, deadline: Deadline) -> None:
    """Mutual proof of the group's key on the group's own connection: swap fresh nonces,
    then swap HMACs over (group id, prover's rank, verifier's nonce, prover's nonce). The rank
    stops a proof being reflected back; the nonces, a proof being replayed into another group.
    `_Unauthenticated` if the peer's proof is wrong."""
    key = bytes.fromhex(group.secret)
    own = secrets.token_bytes(_NONCE_BYTES)
    peer = _exchange(backend, group, own, _NONCE_TAG, deadline, check=lambda _: None)
    proof = _proof(key, group.id, group.rank, verifier_nonce=peer, prover_nonce=own)
    expected = _proof(key, group.id, group.peer_rank, verifier_nonce=own, prover_nonce=peer)

    def check(received: bytes) -> None:
        if not hmac.compare_digest(received, expected):
            raise _Unauthenticated("the peer did not prove it holds the group's secret")

    _exchange(backend, group, proof, _PROOF_TAG, deadline, check)


def _proof(
    key: bytes, group_id: GroupId, rank: int, verifier_nonce: bytes, prover_nonce: bytes
) -> bytes:
    message = b"\0".join((_AUTH_CONTEXT, str(group_id).encode(), str(rank).encode()))
    return hmac.new(key, message + verifier_nonce + prover_nonce, hashlib.sha256).digest()


def _exchange(
    backend: CommBackend,
    group: PairGroup,
    payload: bytes,
    tag: int,
    deadline: Deadline,
    check: Callable[[bytes], None],
) -> bytes:
    """Send `payload` to the peer and receive its message of the same length and tag. The
    peer's message is `check`ed as soon as it arrives: a send is done only once the peer takes
    it, and a peer that failed the check need not."""
    outgoing = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(group.device)
    incoming = torch.empty(len(payload), dtype=torch.uint8, device=group.device)
    # In rank order: NCCL runs a pair's sends and receives on one stream, in posting order,
    # so both ranks receiving first would wait on each other.
    if group.rank == SENDER_RANK:
        sent = backend.send([outgoing], group.peer_rank, tag)
        received = backend.recv([incoming], group.peer_rank, tag)
    else:
        received = backend.recv([incoming], group.peer_rank, tag)
        sent = backend.send([outgoing], group.peer_rank, tag)
    _wait_backend(received, group.id.backend, deadline)
    message = incoming.cpu().numpy().tobytes()
    check(message)
    _wait_backend(sent, group.id.backend, deadline)
    return message


def _wait_backend(work: dist.Work, backend: str, deadline: Deadline) -> None:
    if backend == "nccl":
        _wait_nccl(work, deadline)
    else:
        work.wait(deadline.timedelta())


def _wait_nccl(work: dist.Work, deadline: Deadline) -> None:
    # NCCL's wait only orders streams; completion is polled so the deadline holds.
    while not work.is_completed():
        if deadline.expired():
            raise RuntimeError("timed out waiting for an NCCL operation")
        time.sleep(0.0005)
    work.wait()


def _teardown(backend: CommBackend, name: str, peer_rank: int) -> None:
    if name == "nccl":
        backend.abort()
        return
    # gloo's abort() leaves the connections open. A receive that times out closes every pair
    # of the group, which fails all pending operations here and tells the peer.
    with contextlib.suppress(RuntimeError):
        backend.recv([torch.empty(1)], peer_rank, _TEARDOWN_TAG).wait(_TEARDOWN_WAIT)


class PairGroupPool:
    """The live pair groups of one worker: at most `max_groups`; the least recently used idle
    group makes room for a new one, and idle groups are closed after `idle_timeout_s`.

    `on_close(group)` runs after a group is closed (the receiver drops the open key there).
    Creations and evictions are counted in the metrics under `side` ("sender"/"receiver").
    Thread-safe; closing happens outside the pool's lock.
    """

    def __init__(
        self,
        config: PairGroupConfig,
        on_close: Callable[[PairGroup], None] = lambda group: None,
        clock: Callable[[], float] = time.monotonic,
        side: str = "sender",
    ) -> None:
        self._config = config
        self._side = side
        self._on_close = on_close
        self._clock = clock
        self._lock = threading.Lock()
        self._groups: dict[GroupId, PairGroup] = {}
        self._closed: OrderedDict[GroupId, None] = OrderedDict()

    def group_ids(self) -> list[GroupId]:
        with self._lock:
            return list(self._groups)

    def was_closed(self, group_id: GroupId) -> bool:
        with self._lock:
            return group_id in self._closed

    def admit(self, group: PairGroup, key: TransferKey) -> None:
        """Add a new group, held by one user; PairGroupsExhausted if every slot is busy."""
        with self._lock:
            victim = self._make_room(key)
            group.users, group.last_used = 1, self._clock()
            self._groups[group.id] = group
        metrics.PAIR_GROUPS_CREATED.labels(self._side).inc()
        if victim is not None:
            metrics.PAIR_GROUPS_EVICTED.labels(self._side, "lru").inc()
            self._close(victim, "evicted: least recently used")

    def take_idle(self, match: Callable[[PairGroup], bool]) -> PairGroup | None:
        """The most recently used idle group that `match`es, now held exclusively."""
        with self._lock:
            idle = [g for g in self._groups.values() if g.users == 0 and match(g)]
            if not idle:
                return None
            group = max(idle, key=lambda g: g.last_used)
            group.users = 1
            return group

    def acquire(self, group_id: GroupId) -> PairGroup | None:
        """One more user of a live group, or None if there is no such group."""
        with self._lock:
            group = self._groups.get(group_id)
            if group is not None:
                group.users += 1
            return group

    def release(self, group: PairGroup) -> None:
        """A user is done with the group; it stays open for the next transfer."""
        with self._lock:
            if self._groups.get(group.id) is group:
                group.users -= 1
                group.last_used = self._clock()

    def discard(self, group: PairGroup, reason: str) -> None:
        """Remove and close a group (failed transfer, lost peer)."""
        with self._lock:
            if self._groups.get(group.id) is group:
                del self._groups[group.id]
        metrics.PAIR_GROUPS_EVICTED.labels(self._side, "discarded").inc()
        self._close(group, reason)

    def sweep(self) -> list[GroupId]:
        """Close the groups idle for longer than `idle_timeout_s`; returns their ids."""
        now = self._clock()
        with self._lock:
            stale = [
                g for g in self._groups.values()
                if g.users == 0 and now - g.last_used > self._config.idle_timeout_s
            ]
            for group in stale:
                del self._groups[group.id]
        for group in stale:
            metrics.PAIR_GROUPS_EVICTED.labels(self._side, "idle").inc()
            self._close(group, "evicted: idle")
        return [g.id for g in stale]

    def close_all(self, reason: str) -> None:
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            self._close(group, reason)

    def _make_room(self, key: TransferKey) -> PairGroup | None:
        if len(self._groups) < self._config.max_groups:
            return None
        idle = [g for g in self._groups.values() if g.users == 0]
        if not idle:
            raise PairGroupsExhausted(key, f"all {self._config.max_groups} pair groups are busy")
        victim = min(idle, key=lambda g: g.last_used)
        del self._groups[victim.id]
        return victim

    def _close(self, group: PairGroup, reason: str) -> None:
        with self._lock:
            self._closed[group.id] = None
            while len(self._closed) > _CLOSED_MEMORY:
                self._closed.popitem(last=False)
        group.close(reason)
        self._on_close(group)
