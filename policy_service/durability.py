"""How the policy store runs its Lua scripts, and when a mutation counts as acknowledged.

Reads (`ScriptRunner.read`) are one EVALSHA. A mutation (`ScriptRunner.write`) with
`Durability.replicas = 0` is the same: acknowledged once the master ran it, so a failover to
a replica that had not yet received it loses it. With `replicas = N > 0` the EVALSHA is
pipelined with `WAIT N timeout_ms` on the SAME connection, in one round trip: Redis's WAIT
counts the replicas that acknowledged every write of the connection it is sent on, so a WAIT
on another connection (or node) would confirm nothing. Fewer than N replicas in time raises
`ReplicationLagging` (UNAVAILABLE: the client retries, and every script is safe to retry),
never a silent acknowledgement. A script whose reply is acknowledged always writes something
(an unchanged field where it had nothing to change): a retry whose first attempt wrote but
was not confirmed then still waits for that earlier write, which precedes it in the one
replication stream.

On Redis Cluster the WAIT must go to the master that owns the key's slot. redis-py's
RedisCluster routes each command on its own and sends keyless WAIT to every node, so a
mutation goes through a plain client of that master (`node_client(host, port)`, one per node,
reused), chosen with the cluster client's slot map. A MOVED reply or a node that cannot be
reached makes the cluster client re-read the slot map (`NodesManager.initialize`, which
deduplicates concurrent refreshes); a MOVED mutation is then sent once more to the new owner,
an unreachable node is reported UNAVAILABLE (a failover is under way; the caller retries).

With `pipelining` (the default) concurrent calls go together (`policy_service.batching`): on
one Redis all of them, a batch of mutations then ending with one WAIT; on a cluster the
mutations per master (each master's batch ends with its WAIT), reads one by one through the
cluster client.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.exceptions
from redis.asyncio import Redis, RedisCluster

from policy_service import lua
from policy_service.batching import Batcher
from services.policy.errors import PolicyUnavailable

RedisClient = Redis | RedisCluster
NodeClient = Callable[[str, int], Redis]
_MAX_NODE_CLIENTS = 64
# The node we took for the slot's owner cannot take the write now: re-read the slot map.
_STALE_ROUTE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                redis.exceptions.ReadOnlyError, redis.exceptions.ClusterDownError)


class ReplicationLagging(PolicyUnavailable):
    """Fewer replicas than `redis_wait_replicas` confirmed a mutation within the timeout:
    it is on the master but not acknowledged (UNAVAILABLE, safe to retry)."""


@dataclass(frozen=True)
class Durability:
    """Acknowledge a mutation once `replicas` replicas of its master have it (Redis WAIT),
    waiting at most `timeout_ms`; `replicas = 0` acknowledges on the master's word."""

    replicas: int = 0
    timeout_ms: int = 200

    def __post_init__(self) -> None:
        if not 0 <= self.replicas <= 16:
            raise ValueError(f"redis_wait_replicas: {self.replicas} is not in [0, 16]")
        if not 1 <= self.timeout_ms <= 60_000:
            raise ValueError(f"redis_wait_timeout_ms: {self.timeout_ms} is not in [1, 60000]")


class ScriptRunner:
    """Runs the policy scripts by cached SHA (EVALSHA; SCRIPT LOAD only after NOSCRIPT, e.g.
    on a restarted or newly promoted node) with the acknowledgement `durability` asks for."""

    def __init__(self, client: RedisClient, durability: Durability | None = None,
                 node_client: NodeClient | None = None, pipelining: bool = True) -> None:
        self.client = client
        self.durability = durability or Durability()
        if isinstance(client, RedisCluster) and self.durability.replicas and node_client is None:
            raise ValueError("node_client: needed to WAIT on a Redis Cluster master")
        self._node_client = node_client
        self._nodes: dict[str, Redis] = {}
        self._node_batchers: dict[str, Batcher] = {}  # with `pipelining`: per master, its WAITs
        self._sources = {name: lua.load(name) for name in lua.SCRIPT_NAMES}
        self._shas = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in self._sources.items()}
        self._by_sha = by_sha = {self._shas[name]: source for name, source in self._sources.items()}
        self._pipelining = pipelining
        self._reads: Batcher | None = None
        self._writes: Batcher | None = None
        if pipelining and isinstance(client, Redis):
            self._reads = Batcher(client, by_sha)
            self._writes = Batcher(client, by_sha, self.durability.replicas, self.durability.timeout_ms)

    async def read(self, name: str, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """Run script `name`; its reply as soon as the master answered."""
        if self._reads is not None:
            reply, _ = await self._reads.run(self._shas[name], keys, args)
            return reply
        try:
            return await self.client.evalsha(self._shas[name], len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            await self.client.script_load(self._sources[name])
            return await self.client.evalsha(self._shas[name], len(keys), *keys, *args)

    async def write(self, name: str, keys: Sequence[str], args: Sequence[str | int],
                    acknowledged: Callable[[Any], bool]) -> Any:
        """Run mutation `name`; when `acknowledged(reply)` (the caller will be told it took
        effect), only once `durability.replicas` replicas have it, else ReplicationLagging."""
        if self._writes is not None:
            reply, replicas = await self._writes.run(self._shas[name], keys, args)
        elif not self.durability.replicas:
            return await self.read(name, keys, args)
        elif not isinstance(self.client, RedisCluster):
            reply, replicas = await self._with_wait(self.client, name, keys, args)
        else:
            reply, replicas = await self._on_slot_owner(name, keys, args)
        if acknowledged(reply) and replicas < self.durability.replicas:
            raise ReplicationLagging(
                f"{replicas} of {self.durability.replicas} replicas confirmed the write within "
                f"{self.durability.timeout_ms} ms", field="redis_wait_replicas")
        return reply

    async def _with_wait(self, target: Redis, name: str, keys: Sequence[str],
                         args: Sequence[str | int]) -> tuple[Any, int]:
        """EVALSHA then WAIT, pipelined on one connection of `target` (a retry on a lost
        connection re-sends both together)."""
        for _ in range(2):
            async with target.pipeline(transaction=False) as pipe:
                pipe.evalsha(self._shas[name], len(keys), *keys, *args)
                pipe.wait(self.durability.replicas, self.durability.timeout_ms)
                reply, replicas = await pipe.execute(raise_on_error=False)
            if not isinstance(reply, redis.exceptions.NoScriptError):
                break
            await target.script_load(self._sources[name])
        if isinstance(reply, Exception):
            raise reply
        # A WAIT that failed (a node demoted to replica answers it with an error) confirmed nothing.
        return reply, 0 if isinstance(replicas, Exception) else int(replicas)

    async def _on_slot_owner(self, name: str, keys: Sequence[str],
                             args: Sequence[str | int]) -> tuple[Any, int]:
        """EVALSHA + WAIT on the master that owns the slot of `keys` (one slot, every
        script), batched with the other calls to it when pipelining; after a MOVED, once more
        on the new owner."""
        try:
            return await self._on_master(keys[0], name, keys, args)
        except redis.exceptions.MovedError:
            await self._refresh_slots()
        except _STALE_ROUTE:
            await self._refresh_slots()
            raise
        return await self._on_master(keys[0], name, keys, args)

    async def _on_master(self, key: str, name: str, keys: Sequence[str],
                         args: Sequence[str | int]) -> tuple[Any, int]:
        node = self._node_name(key)
        master = self._master(node)
        if not self._pipelining:
            return await self._with_wait(master, name, keys, args)
        if node not in self._node_batchers:
            self._node_batchers[node] = Batcher(master, self._by_sha, self.durability.replicas,
                                                self.durability.timeout_ms)
        return await self._node_batchers[node].run(self._shas[name], keys, args)

    def _master(self, name: str) -> Redis:
        """A plain client of master `name` (host:port; made once per master)."""
        assert self._node_client is not None
        if name not in self._nodes:
            if len(self._nodes) >= _MAX_NODE_CLIENTS:
                raise redis.exceptions.ConnectionError(f"more than {_MAX_NODE_CLIENTS} cluster masters seen")
            host, port = name.rsplit(":", 1)
            self._nodes[name] = self._node_client(host, int(port))
        return self._nodes[name]

    def _node_name(self, key: str) -> str:
        """host:port of the master that owns `key`'s slot, in the cluster client's slot map."""
        assert isinstance(self.client, RedisCluster)
        node = self.client.get_node_from_key(key)
        if node is None:
            raise redis.exceptions.SlotNotCoveredError(f"no cluster node serves the slot of {key}")
        return str(node.name)

    async def _refresh_slots(self) -> None:
        assert isinstance(self.client, RedisCluster)
        # No node may answer yet (mid-failover): the next call tries again.
        with contextlib.suppress(redis.exceptions.RedisClusterException, redis.exceptions.RedisError):
            await self.client.nodes_manager.initialize()

    async def aclose(self) -> None:
        """Close the per-master clients (the cluster client is its owner's to close)."""
        for node in self._nodes.values():
            await node.aclose(close_connection_pool=True)
        self._nodes.clear()
        self._node_batchers.clear()
