"""`kvrelay bench transfer`: bytes/s of a packed view through a gloo pair group vs a plain
loopback TCP copy of the same bytes, measured in the same run.

This process is the prefill side; a spawned process is the decode side, hosting both the
rendezvous store and a TCP listener. Each repeat moves the same view once through the
transfer layer (reserve, descriptor over a pipe standing in for gRPC, layer-by-layer
send, full receive and validation) and once as raw bytes over a warm TCP connection
(the same tensors, `sendall` / `recv_into`), interleaved so both see the same machine
load. A repeat ends when the receiver's acknowledgement arrives. The first transfer also
builds the pair group and is reported apart (`cold_s`), with the part of it the sender spent
proving the group's key (`auth_s`: the nonce and HMAC swap, once per new group; transfers on
a group that is already up add no round trip); throughput counts warm repeats.

Each repeat also times the receipt's payload digest (XXH3-128 of every layer's K and V bytes,
`services.kvpolicy.receipt`) on both sides, outside the transfer's timing: the sender digests
the view before it sends (as `make_receipt` does at prefill), the receiver checks the view that
arrived against it (as the decode worker's verify stage does before admitting it); a mismatch
fails the bench. The report gives each as a fraction of the warm transfer time.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from services.kvpolicy.packing import OFFSET_DTYPE, POSITION_DTYPE, PackedKVView
from services.kvpolicy.receipt import PAYLOAD_HASH, PayloadDigest, check_payload, payload_digest
from services.rpc.kvrelay.v1 import decode_pb2
from services.transfer.codec import descriptor_from_proto, descriptor_to_proto
from services.transfer.deadline import Deadline
from services.transfer.descriptor import TransferDescriptor
from services.transfer.errors import TransferKey
from services.transfer.layout import ViewLayout, dtype_from_name, layer_of
from services.transfer.receiver import KVReceiver
from services.transfer.sender import KVSender

_PEER_START_S = 120.0
_SENDER_ID = "bench-prefill"


@dataclass(frozen=True)
class TransferBenchConfig:
    """The view to move (default: a 4K-token prompt at a 25% budget, 32 layers x 8 K/V heads
    x 128 dims, bfloat16 = 128 MiB of payload) and how often."""

    num_layers: int = 32
    num_kv_heads: int = 8
    rows_per_head: int = 1024
    head_dim: int = 128
    dtype: str = "bfloat16"
    repeats: int = 5
    deadline_s: float = 120.0
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "rows_per_head", "head_dim", "repeats", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.deadline_s <= 0:
            raise ValueError(f"deadline_s: must be > 0, got {self.deadline_s}")
        dtype_from_name(self.dtype, "dtype")


@dataclass(frozen=True)
class TransferBenchResult:
    """Seconds per warm repeat of each path, for `bytes_per_transfer` bytes each."""

    config: TransferBenchConfig
    bytes_per_transfer: int
    cold_s: float
    gloo_s: tuple[float, ...]
    tcp_s: tuple[float, ...]
    first_layer_s: tuple[float, ...]  # receiver: start_recv -> layer 0 usable
    full_view_s: tuple[float, ...]  # receiver: start_recv -> validated view
    digest_send_s: tuple[float, ...] = ()  # sender: payload digest of the view (warm repeats)
    digest_recv_s: tuple[float, ...] = ()  # receiver: the view that arrived checked against it
    auth_s: float = 0.0  # sender: the pair group's key handshake, inside `cold_s`

    @property
    def gloo_bytes_per_s(self) -> float:
        return self.bytes_per_transfer * len(self.gloo_s) / sum(self.gloo_s)

    @property
    def tcp_bytes_per_s(self) -> float:
        return self.bytes_per_transfer * len(self.tcp_s) / sum(self.tcp_s)

    @property
    def ratio(self) -> float:
        """Transfer-layer throughput as a fraction of the raw TCP copy (goal >= 0.5)."""
        return self.gloo_bytes_per_s / self.tcp_bytes_per_s

    @property
    def digest_send_fraction(self) -> float:
        """Median sender-side payload digest time over the median warm transfer time."""
        return statistics.median(self.digest_send_s) / statistics.median(self.gloo_s)

    @property
    def digest_recv_fraction(self) -> float:
        """Median receiver-side payload check time over the median warm transfer time."""
        return statistics.median(self.digest_recv_s) / statistics.median(self.gloo_s)


def run_transfer_bench(config: TransferBenchConfig) -> TransferBenchResult:
    """Spawn the decode-side process, run the interleaved repeats, return the timings."""
    torch.set_num_threads(config.threads)
    view = bench_view(config)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    peer = ctx.Process(target=_decode_peer, args=(child, config.threads), daemon=True)
    peer.start()
    try:
        store_address, tcp_port = _expect(conn, "ready", _PEER_START_S)[1:]
        sender = KVSender(_SENDER_ID)
        with socket.create_connection(("127.0.0.1", tcp_port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return _measure(config, view, conn, sender, store_address, sock)
    finally:
        conn.send(("stop", None))
        peer.join(10)
        if peer.is_alive():
            peer.kill()


def bench_view(config: TransferBenchConfig) -> PackedKVView:
    """A packed view with `rows_per_head` rows in every (layer, K/V head) segment."""
    rows, heads, layers = config.rows_per_head, config.num_kv_heads, config.num_layers
    total = rows * heads * layers
    dtype = dtype_from_name(config.dtype, "dtype")
    generator = torch.Generator().manual_seed(0)
    offsets = torch.arange(0, total + 1, rows, dtype=OFFSET_DTYPE)  # [L * H + 1]
    row_offsets = torch.stack([offsets[n * heads : (n + 1) * heads + 1] for n in range(layers)])  # [L, H + 1]
    return PackedKVView(
        packed_k=torch.randn(total, config.head_dim, generator=generator).to(dtype),  # [R_total, d_h]
        packed_v=torch.randn(total, config.head_dim, generator=generator).to(dtype),  # [R_total, d_h]
        original_position_map=torch.arange(rows, dtype=POSITION_DTYPE).repeat(heads * layers),  # [R_total]
        row_offsets=row_offsets,
    )


def print_transfer_report(result: TransferBenchResult, json_out: Path | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = result.bytes_per_transfer / 2**20
    table = Table(title=f"packed view of {mib:.1f} MiB over loopback, {len(result.gloo_s)} warm repeats each")
    for column in ("path", "MiB/s", "median s", "best s"):
        table.add_column(column, justify="right")
    for path, seconds, rate in (
        ("gloo pair group (kvrelay transfer)", result.gloo_s, result.gloo_bytes_per_s),
        ("plain TCP socket copy", result.tcp_s, result.tcp_bytes_per_s),
    ):
        table.add_row(path, f"{rate / 2**20:.0f}", f"{statistics.median(seconds):.4f}", f"{min(seconds):.4f}")
    Console(width=120).print(table)
    print(
        f"gloo / TCP = {result.ratio:.2f} (goal >= 0.50); first transfer incl. rendezvous {result.cold_s:.3f} s; "
        f"receiver has layer 0 after {statistics.median(result.first_layer_s) * 1e3:.1f} ms, "
        f"the whole view after {statistics.median(result.full_view_s) * 1e3:.1f} ms (medians); "
        f"host: {os.cpu_count()} CPUs"
    )
    print(
        f"payload digest ({PAYLOAD_HASH}, K and V per layer): receiver check"
        f" {statistics.median(result.digest_recv_s) * 1e3:.1f} ms = {result.digest_recv_fraction:.1%}"
        f" of the transfer, sender {statistics.median(result.digest_send_s) * 1e3:.1f} ms"
        f" = {result.digest_send_fraction:.1%} (medians of warm repeats)"
    )
    print(
        f"pair-group authentication (nonce + HMAC-SHA256 proof swap, once per new group):"
        f" {result.auth_s * 1e3:.2f} ms = {result.auth_s / result.cold_s:.2%} of the first transfer;"
        f" warm transfers on the group add none"
    )
    if json_out is not None:
        payload = asdict(result) | {
            "gloo_bytes_per_s": result.gloo_bytes_per_s,
            "tcp_bytes_per_s": result.tcp_bytes_per_s,
            "ratio": result.ratio,
            "digest_send_fraction": result.digest_send_fraction,
            "digest_recv_fraction": result.digest_recv_fraction,
        }
        json_out.write_text(json.dumps(payload, indent=2))


def _measure(
    config: TransferBenchConfig, view: PackedKVView, conn: Connection, sender: KVSender,
    store_address: str, sock: socket.socket,
) -> TransferBenchResult:
    cold_s, _, _, auth_s = _transfer_once(config, view, conn, sender, store_address, "cold")
    _copy_once(view, conn, sock)  # warm the TCP path too
    gloo_s, tcp_s, receiver_times, digest_send_s = [], [], [], []
    for repeat in range(config.repeats):
        seconds, times, digest_s, _ = _transfer_once(config, view, conn, sender, store_address, f"warm-{repeat}")
        gloo_s.append(seconds)
        receiver_times.append(times)
        digest_send_s.append(digest_s)
        tcp_s.append(_copy_once(view, conn, sock))
    sender.close()
    return TransferBenchResult(
        config=config,
        bytes_per_transfer=ViewLayout.of(view).nbytes,
        cold_s=cold_s,
        gloo_s=tuple(gloo_s),
        tcp_s=tuple(tcp_s),
        first_layer_s=tuple(t[0] for t in receiver_times),
        full_view_s=tuple(t[1] for t in receiver_times),
        digest_send_s=tuple(digest_send_s),
        digest_recv_s=tuple(t[2] for t in receiver_times),
        auth_s=auth_s if auth_s is not None else float("nan"),
    )


def _transfer_once(
    config: TransferBenchConfig, view: PackedKVView, conn: Connection, sender: KVSender,
    store_address: str, transfer_id: str,
) -> tuple[float, tuple[float, float, float], float, float | None]:
    """One transfer through the pair group: (seconds until the receiver acknowledged, the
    receiver's (first layer, full view, payload check) seconds, the sender's digest seconds,
    the group's key handshake seconds)."""
    digest_started = time.perf_counter()
    payload = payload_digest(view)
    digest_s = time.perf_counter() - digest_started
    deadline = Deadline.after(config.deadline_s)
    key = TransferKey(f"bench-{transfer_id}", 1, 1, transfer_id)
    started = time.perf_counter()
    lease = sender.reserve(key, store_address, "cpu", deadline)
    descriptor = TransferDescriptor(
        transfer_id=transfer_id,
        request_id=key.request_id,
        request_generation=key.request_generation,
        state_generation=key.state_generation,
        cache_generation=0,
        receipt_digest="0" * 64,
        source_worker=sender.worker_id,
        route=lease.route,
        layout=ViewLayout.of(view),
    )
    transfer = sender.start_send(descriptor, lease, deadline)
    conn.send(("transfer", (descriptor_to_proto(descriptor).SerializeToString(), config.deadline_s, payload)))
    for layer in range(view.num_layers):
        transfer.send_layer(layer_of(view, layer))
    transfer.wait_for_send(deadline)
    _, received, first_layer_s, full_view_s, check_s = _expect(conn, "received", config.deadline_s)
    elapsed = time.perf_counter() - started
    assert received == transfer.bytes_moved == descriptor.layout.nbytes, "bytes moved differ from the layout"
    return elapsed, (first_layer_s, full_view_s, check_s), digest_s, lease.group.auth_s


def _copy_once(view: PackedKVView, conn: Connection, sock: socket.socket) -> float:
    tensors = [t for layer in range(view.num_layers) for t in layer_of(view, layer).wire_tensors()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    started = time.perf_counter()
    conn.send(("copy", nbytes))
    for tensor in tensors:
        sock.sendall(tensor.contiguous().view(torch.uint8).numpy().data)
    _expect(conn, "copied", _PEER_START_S)
    return time.perf_counter() - started


def _expect(conn: Connection, tag: str, timeout: float) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise TimeoutError(f"bench peer sent nothing within {timeout}s (expected {tag!r})")
    reply = conn.recv()
    if reply[0] != tag:
        raise RuntimeError(f"bench peer: expected {tag!r}, got {reply!r}")
    return reply


def _decode_peer(conn: Connection, threads: int) -> None:
    """The decode side: receives views through the transfer layer and raw bytes over TCP."""
    torch.set_num_threads(threads)
    receiver = KVReceiver()
    with socket.create_server(("127.0.0.1", 0)) as server:
        conn.send(("ready", receiver.address, server.getsockname()[1]))
        client, _ = server.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            command, args = conn.recv()
            if command == "stop":
                break
            if command == "transfer":
                conn.send(("received", *_receive_view(receiver, *args)))
            else:
                _receive_bytes(client, args)
                conn.send(("copied",))
        client.close()
    receiver.close()


def _receive_view(
    receiver: KVReceiver, descriptor_bytes: bytes, deadline_s: float, payload: PayloadDigest
) -> tuple[int, float, float, float]:
    """Receive one view; then, after its timing, check its bytes against the sender's digest."""
    started = time.perf_counter()
    descriptor = descriptor_from_proto(decode_pb2.TransferDescriptor.FromString(descriptor_bytes))
    deadline = Deadline.after(deadline_s)
    transfer = receiver.start_recv(descriptor, deadline)
    transfer.wait_for_layer(0, deadline)
    first_layer = time.perf_counter() - started
    view = transfer.wait_for_view(deadline)
    full_view = time.perf_counter() - started
    check_started = time.perf_counter()
    check_payload(payload, view)  # ReceiptMismatch ends the peer, and so the bench
    return transfer.bytes_moved, first_layer, full_view, time.perf_counter() - check_started


def _receive_bytes(client: socket.socket, nbytes: int) -> None:
    buffer = torch.empty(nbytes, dtype=torch.uint8)  # allocated per copy, as the view's buffers are
    view = buffer.numpy().data
    received = 0
    while received < nbytes:
        got = client.recv_into(view[received:], nbytes - received)
        if got == 0:
            raise ConnectionError("sender closed the bench connection")
        received += got
