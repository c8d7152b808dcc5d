"""Automatic pipelining: script calls that concurrent RPCs make while earlier ones are still
in flight go to Redis together, as one pipeline (one write, one connection, replies read in
order), not one round trip each.

Why: under load most of a policy call's own cost is per Redis round trip (a connection taken
from the pool, a send system call that wakes redis-server, a read) and the event-loop turns
around it; a batch pays them once. A call made while fewer than `MAX_IN_FLIGHT` calls or
batches are out is sent at once, alone, from the caller's own task, as a plain command (no
pipeline, no extra task) unless it must WAIT: a single client pays nothing for this. Calls
arriving while that many are out queue, and go together as soon as one comes back (group
commit: the busier Redis is, the larger the batches), or after `MAX_QUEUE_WAIT_S` if none
came back by then (a Redis that stopped answering: what is out is stuck in its retries, and
the calls behind it must not wait for those to fail before trying on their own).

How much this gains depends on whether calls pile up. In this process's store at 64
concurrent callers they do (`kvrelay bench policy --unpipelined`: the in-process store
rows); behind the gRPC server they mostly do not, because requests reach the handlers one
event-loop turn apart and Redis answers sooner (batches of ~1.1 calls on average at 64
clients on a 2-CPU host): there the gRPC layer, not Redis, bounds a process. With `wait_replicas` the batch ends with one
`WAIT n timeout` that covers every write before it on that connection (Redis counts a
connection's writes up to its last), so a batch of mutations waits for its replicas once.

Each caller gets its own reply, or its own error reply (a stale publish does not fail its
neighbours); a connection lost under a batch fails every call in it, UNAVAILABLE, as it
would have failed them one by one. A script missing from the Redis script cache (NOSCRIPT,
after a restart or a failover) is loaded and its calls sent once more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.exceptions
from redis.asyncio import Redis

MAX_BATCH = 128  # calls per pipeline: bounds one reply's size and one batch's latency
MAX_IN_FLIGHT = 2  # pipelines out at once (Redis runs one command at a time anyway)
MAX_QUEUE_WAIT_S = 0.005  # then a queued batch goes out even with MAX_IN_FLIGHT out


@dataclass(frozen=True)
class _Call:
    """One queued call; `reply` receives (reply or error reply, replicas confirmed)."""

    sha: str
    keys: Sequence[str]
    args: Sequence[str | int]
    reply: asyncio.Future[tuple[Any, int]]

    @property
    def command(self) -> Command:
        return self.sha, self.keys, self.args


Command = tuple[str, Sequence[str], Sequence[str | int]]  # (script SHA-1, KEYS, ARGV)


class Batcher:
    """Sends EVALSHA calls to `client`, queued ones together as one pipeline, ending with
    `WAIT wait_replicas wait_timeout_ms` when `wait_replicas` > 0. `sources` maps each
    script's SHA-1 to its source (to load it after NOSCRIPT)."""

    def __init__(self, client: Redis, sources: Mapping[str, str], wait_replicas: int = 0,
                 wait_timeout_ms: int = 0) -> None:
        self.client = client
        self.sources = sources
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._queue: list[_Call] = []
        self._in_flight = 0  # calls sent alone and batches out
        self._batches: set[asyncio.Task[None]] = set()  # referenced until done
        self._overdue: asyncio.TimerHandle | None = None

    async def run(self, sha: str, keys: Sequence[str], args: Sequence[str | int]) -> tuple[Any, int]:
        """The script's reply (an error reply is raised) and how many replicas confirmed the
        write (0 without `wait_replicas`)."""
        loop = asyncio.get_running_loop()
        if self._in_flight < MAX_IN_FLIGHT and not self._queue:
            reply, replicas = await self._alone(sha, keys, args)
        else:
            call = _Call(sha, keys, args, loop.create_future())
            self._queue.append(call)
            if self._overdue is None:
                self._overdue = loop.call_later(MAX_QUEUE_WAIT_S, self._flush)
            reply, replicas = await call.reply
        if isinstance(reply, Exception):
            raise reply
        return reply, replicas

    async def _alone(self, sha: str, keys: Sequence[str], args: Sequence[str | int]) -> tuple[Any, int]:
        self._in_flight += 1
        try:
            if self.wait_replicas:
                (reply,), replicas = await self._with_reload([(sha, keys, args)])
                return reply, replicas
            try:
                return await self.client.evalsha(sha, len(keys), *keys, *args), 0
            except redis.exceptions.NoScriptError:
                await self.client.script_load(self.sources[sha])
                return await self.client.evalsha(sha, len(keys), *keys, *args), 0
        finally:
            self._in_flight -= 1
            self._flush()

    def _flush(self) -> None:
        """Send up to MAX_BATCH queued calls as one batch (when there are any)."""
        if self._overdue is not None:
            self._overdue.cancel()
            self._overdue = None
        if not self._queue:
            return
        batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._batches.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._batches.discard(task)
        self._in_flight -= 1
        self._flush()

    async def _send(self, batch: list[_Call]) -> None:
        try:
            replies, replicas = await self._with_reload([call.command for call in batch])
        except BaseException as exc:  # handed to every caller of the batch
            for call in (c for c in batch if not c.reply.done()):
                if isinstance(exc, Exception):
                    call.reply.set_exception(exc)
                else:
                    call.reply.cancel()
            if not isinstance(exc, Exception):
                raise  # cancelled (the loop is shutting down): its callers are cancelled too
            return
        for call, reply in zip(batch, replies, strict=True):
            if not call.reply.done():  # a caller whose deadline passed is gone
                call.reply.set_result((reply, replicas))

    async def _with_reload(self, commands: list[Command]) -> tuple[list[Any], int]:
        """`_pipeline`, and once more for the calls whose script Redis did not know."""
        replies, replicas = await self._pipeline(commands)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, redis.exceptions.NoScriptError)]
        if missing:
            for sha in {commands[i][0] for i in missing}:
                await self.client.script_load(self.sources[sha])
            again, confirmed = await self._pipeline([commands[i] for i in missing])
            replicas = min(replicas, confirmed)
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies, replicas

    async def _pipeline(self, commands: list[Command]) -> tuple[list[Any], int]:
        async with self.client.pipeline(transaction=False) as pipe:
            for sha, keys, args in commands:
                pipe.evalsha(sha, len(keys), *keys, *args)
            if self.wait_replicas:
                pipe.wait(self.wait_replicas, self.wait_timeout_ms)
            results = await pipe.execute(raise_on_error=False)
        if not self.wait_replicas:
            return list(results), 0
        confirmed = results.pop()
        # A WAIT that failed (sent to a node demoted to replica: its calls were answered MOVED)
        # confirmed nothing: each call keeps its own reply or error.
        return list(results), 0 if isinstance(confirmed, Exception) else int(confirmed)
