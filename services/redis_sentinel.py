"""A private Redis Sentinel deployment on 127.0.0.1 (one master, its replicas, three
sentinels), for tests and benches of failover.

Every process is an `EmbeddedRedis` (same binary, one generated password, parent-death
signal, 0600 config, random free loopback port). Data nodes carry `masterauth`, so any of
them can replicate from whichever is master after a failover; replicas start with
`replicaof` the first node. Sentinels run the same redis-server binary in sentinel mode:
redis-server enters it when its argv[0] names `redis-sentinel` (how `make install` ships
redis-sentinel, a link to redis-server), so each deployment puts such a symlink in a private
directory and hands it to EmbeddedRedis as the executable (whose config file the sentinel then
rewrites as it learns the topology, as it must). Sentinels require the same password
(`requirepass`) and use it with each other (`sentinel sentinel-pass`) and with the data nodes
(`sentinel auth-pass`).

Failover is fast: a master unreachable for `down_after_ms` (default 1 s) is subjectively down,
objectively down once a quorum (a majority of the sentinels) agrees, and the elected sentinel
promotes the replica with the most replication data; about 2-4 s in all on loopback. `start()`
returns once every replica's link is up and every sentinel sees the master, all its replicas
and every other sentinel (so the first failover can already be elected).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from services.redis_embedded import (
    EmbeddedRedis,
    EmbeddedRedisConfig,
    EmbeddedRedisError,
    find_redis_server,
)

_POLL_S = 0.05


@dataclass(frozen=True)
class EmbeddedSentinelConfig:
    """One master with `replicas` replicas watched by `sentinels` sentinels under
    `master_name`; `down_after_ms` is how long the master may be unreachable before the
    sentinels take it for down, `failover_timeout_ms` how long one failover attempt may take."""

    replicas: int = 2
    sentinels: int = 3
    master_name: str = "kvrelay"
    down_after_ms: int = 1000
    failover_timeout_ms: int = 3000
    start_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 4:
            raise ValueError(f"replicas: {self.replicas} is not in [1, 4] (a failover needs one)")
        if not 1 <= self.sentinels <= 7:
            raise ValueError(f"sentinels: {self.sentinels} is not in [1, 7]")
        if not self.master_name or not all(c.isalnum() or c in "._-" for c in self.master_name):
            raise ValueError(f"master_name: {self.master_name[:40]!r} is not letters, digits, "
                             "'.', '_', '-'")
        if self.down_after_ms < 100 or self.failover_timeout_ms < self.down_after_ms:
            raise ValueError("down_after_ms/failover_timeout_ms: need 100 <= down_after_ms "
                             "<= failover_timeout_ms")
        if self.start_timeout_s <= 0:
            raise ValueError("start_timeout_s: must be positive")

    @property
    def quorum(self) -> int:
        """Sentinels that must agree the master is down: a majority."""
        return self.sentinels // 2 + 1


class EmbeddedSentinelDeployment:
    """A running master, its replicas and their sentinels. `nodes` keeps the creation order
    (the first was created as master; a failover may since have swapped roles)."""

    def __init__(self, config: EmbeddedSentinelConfig | None = None) -> None:
        self.config = config or EmbeddedSentinelConfig()
        self.password = secrets.token_urlsafe(24)
        self.nodes: list[EmbeddedRedis] = []
        self.sentinels: list[EmbeddedRedis] = []
        self._bin_dir: Path | None = None

    @property
    def url(self) -> str:
        """The policy service's URL: every sentinel, the master's name, database 0."""
        hosts = ",".join(f"127.0.0.1:{sentinel.port}" for sentinel in self.sentinels)
        return f"redis+sentinel://:{self.password}@{hosts}/{self.config.master_name}/0"

    def start(self) -> None:
        """Start the master, its replicas and the sentinels; wait until all see each other."""
        deadline = time.monotonic() + self.config.start_timeout_s
        try:
            master = self._start_node(self._node_config(replica_of=None))
            for _ in range(self.config.replicas):
                self._start_node(self._node_config(replica_of=master.port))
            self._wait(deadline, self._replication_problem)
            executable = self._sentinel_executable()
            for _ in range(self.config.sentinels):
                sentinel = EmbeddedRedis(self._sentinel_config(executable, master.port))
                self.sentinels.append(sentinel)
                sentinel.start()
            self._wait(deadline, self._sentinel_problem)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every process this deployment started and remove their directories."""
        for process in [*self.sentinels, *self.nodes]:
            with contextlib.suppress(Exception):  # stop the others even if one will not
                process.close()
        self.sentinels, self.nodes = [], []
        if self._bin_dir is not None:
            shutil.rmtree(self._bin_dir, ignore_errors=True)
            self._bin_dir = None

    def __enter__(self) -> EmbeddedSentinelDeployment:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def client(self, process: EmbeddedRedis) -> redis.Redis:
        """A plain client of one data node or sentinel, for inspection and tests."""
        return redis.Redis(host="127.0.0.1", port=process.port, password=self.password,
                           socket_timeout=2.0, socket_connect_timeout=2.0, decode_responses=True)

    def master_port(self) -> int | None:
        """The master's port as a majority of the running sentinels report it (None: no
        majority agrees, e.g. mid-failover)."""
        votes: dict[int, int] = {}
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            with contextlib.suppress(redis.RedisError), self.client(sentinel) as direct:
                address = direct.execute_command("SENTINEL", "get-master-addr-by-name",
                                                 self.config.master_name)
                if address:
                    votes[int(address[1])] = votes.get(int(address[1]), 0) + 1
        agreed = [port for port, count in votes.items() if count >= self.config.quorum]
        return agreed[0] if agreed else None

    def master(self) -> EmbeddedRedis:
        """The running data node the sentinels take for master now."""
        port = self.master_port()
        for node in self.nodes:
            if node.running and node.port == port:
                return node
        raise EmbeddedRedisError(f"no running node is the master the sentinels name (port {port})")

    def kill_master(self) -> EmbeddedRedis:
        """SIGKILL the current master (no shutdown, no last word to its replicas); it stays
        down. Returns the node killed."""
        node = self.master()
        node.kill()
        return node

    def wait_promoted(self, old_port: int, timeout_s: float) -> EmbeddedRedis:
        """Until a majority of the sentinels name a master other than `old_port` and that node
        says it is master; the node."""
        deadline = time.monotonic() + timeout_s
        while True:
            port = self.master_port()
            if port is not None and port != old_port:
                node = next((n for n in self.nodes if n.running and n.port == port), None)
                if node is not None and self._role(node) == "master":
                    return node
            if time.monotonic() > deadline:
                raise EmbeddedRedisError(f"no replica promoted within {timeout_s}s "
                                         f"(the sentinels name port {port})")
            time.sleep(_POLL_S)

    def _start_node(self, config: EmbeddedRedisConfig) -> EmbeddedRedis:
        node = EmbeddedRedis(config)
        self.nodes.append(node)
        node.start()
        return node

    def _node_config(self, replica_of: int | None) -> EmbeddedRedisConfig:
        lines = [f'masterauth "{self.password}"']
        if replica_of is not None:
            lines.append(f"replicaof 127.0.0.1 {replica_of}")
        return EmbeddedRedisConfig(password=self.password, extra_config=tuple(lines))

    def _sentinel_executable(self) -> str:
        """A `redis-sentinel` symlink to the redis-server binary, in a private directory."""
        self._bin_dir = Path(tempfile.mkdtemp(prefix="kvrelay-sentinel-bin-"))
        link = self._bin_dir / "redis-sentinel"
        link.symlink_to(find_redis_server())
        return str(link)

    def _sentinel_config(self, executable: str, master_port: int) -> EmbeddedRedisConfig:
        name, config = self.config.master_name, self.config
        return EmbeddedRedisConfig(
            password=self.password,
            executable=executable,
            extra_config=(
                f"sentinel monitor {name} 127.0.0.1 {master_port} {config.quorum}",
                f'sentinel auth-pass {name} "{self.password}"',
                f'sentinel sentinel-pass "{self.password}"',
                f"sentinel down-after-milliseconds {name} {config.down_after_ms}",
                f"sentinel failover-timeout {name} {config.failover_timeout_ms}",
                f"sentinel parallel-syncs {name} 1",
            ),
        )

    def _role(self, node: EmbeddedRedis) -> str | None:
        with contextlib.suppress(redis.RedisError), self.client(node) as direct:
            return str(direct.info("replication")["role"])
        return None

    def _replication_problem(self) -> str | None:
        for node in self.nodes[1:]:
            with contextlib.suppress(redis.RedisError), self.client(node) as direct:
                if direct.info("replication").get("master_link_status") == "up":
                    continue
            return f"replica {node.port}: link to its master is not up"
        return None

    def _sentinel_problem(self) -> str | None:
        for sentinel in self.sentinels:
            try:
                with self.client(sentinel) as direct:
                    state = direct.execute_command("SENTINEL", "master", self.config.master_name)
            except redis.RedisError as exc:
                return f"sentinel {sentinel.port}: {type(exc).__name__}"
            if isinstance(state, list):  # a flat field, value, ... reply
                state = dict(zip(state[::2], state[1::2], strict=True))
            fields = state
            if fields.get("flags") != "master":
                return f"sentinel {sentinel.port}: master flags {fields.get('flags')}"
            if int(fields.get("num-slaves", 0)) < self.config.replicas:
                return f"sentinel {sentinel.port}: sees {fields.get('num-slaves')} replicas"
            if int(fields.get("num-other-sentinels", 0)) < self.config.sentinels - 1:
                others = fields.get("num-other-sentinels")
                return f"sentinel {sentinel.port}: sees {others} other sentinels"
        return None

    def _wait(self, deadline: float, problem_of: Callable[[], str | None]) -> None:
        while (problem := problem_of()) is not None:
            if time.monotonic() > deadline:
                raise EmbeddedRedisError(f"redis sentinel deployment not ready in time: {problem}")
            time.sleep(_POLL_S)
