"""Automatic pipelining (policy_service.batching) on a real Redis: concurrent calls share
pipelines, each caller gets its own reply or its own error, a flushed script cache is
reloaded, and a lost connection fails the batch's calls (nothing hangs)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
import redis.exceptions
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from policy_service import batching
from policy_service.batching import Batcher
from services.redis_embedded import EmbeddedRedis

# Returns its key's new value, or a Lua error for a negative increment.
SCRIPT = "if tonumber(ARGV[1]) < 0 then return redis.error_reply('negative') end " \
         "return redis.call('INCRBY', KEYS[1], ARGV[1])"
SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()


class CountingBatcher(Batcher):
    def __init__(self, client: Redis) -> None:
        super().__init__(client, {SHA: SCRIPT})
        self.pipelines = 0
        self.piped: set[int] = set()  # the calls that went in a pipeline (their ARGV lists)

    async def _pipeline(self, commands: list[batching.Command]) -> tuple[list[Any], int]:
        self.pipelines += 1
        self.piped.update(id(args) for _, _, args in commands)
        return await super()._pipeline(commands)


async def test_concurrent_calls_share_pipelines_and_keep_their_own_replies(redis_server: EmbeddedRedis) -> None:
    async with Redis.from_url(redis_server.url, decode_responses=True) as client:
        await client.script_flush()  # the first batch meets NOSCRIPT: loaded and sent again
        batcher = CountingBatcher(client)
        argvs = [[1 if i != 7 else -1] for i in range(64)]
        calls = [batcher.run(SHA, [f"batch:{i % 4}"], argvs[i]) for i in range(64)]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        failed = [i for i, r in enumerate(replies) if isinstance(r, Exception)]
        assert failed == [7] and "negative" in str(replies[7])  # its neighbours are unaffected
        assert sorted(str(v) for v in await client.mget([f"batch:{k}" for k in range(4)])) == ["15", "16", "16", "16"]
        assert all(r[1] == 0 for r in replies if isinstance(r, tuple))
        # MAX_IN_FLIGHT calls went alone (plain EVALSHA, the first two); every other one queued
        # behind them and went in a pipeline: as few as MAX_BATCH allows, each sent at most
        # twice (again after the reload that NOSCRIPT asks for).
        piped = [i for i, argv in enumerate(argvs) if id(argv) in batcher.piped]
        assert piped == list(range(batching.MAX_IN_FLIGHT, 64))
        batches = -(-(64 - batching.MAX_IN_FLIGHT) // batching.MAX_BATCH)
        assert batches <= batcher.pipelines <= 2 * batches, batcher.pipelines
        alone = await batcher.run(SHA, ["batch:alone"], [5])
        assert alone == (5, 0)


async def test_a_lost_connection_fails_every_call_of_the_batch(redis_server: EmbeddedRedis) -> None:
    async with Redis(host="127.0.0.1", port=redis_server.port, password=redis_server.password,
                     decode_responses=True, retry=Retry(NoBackoff(), 0)) as client:
        await client.ping()
        redis_server.kill()
        try:
            batcher = Batcher(client, {SHA: SCRIPT})
            results = await asyncio.wait_for(asyncio.gather(
                *(batcher.run(SHA, ["lost"], [1]) for _ in range(8)), return_exceptions=True), timeout=10)
            assert all(isinstance(r, redis.exceptions.ConnectionError) for r in results), results
        finally:
            redis_server.start()


async def test_the_wait_covers_the_batch_and_reports_its_replicas(redis_server: EmbeddedRedis) -> None:
    async with Redis.from_url(redis_server.url, decode_responses=True) as client:
        batcher = Batcher(client, {SHA: SCRIPT}, wait_replicas=1, wait_timeout_ms=20)
        with pytest.raises(redis.exceptions.ResponseError, match="negative"):
            await batcher.run(SHA, ["wait"], [-1])
        # No replica: the write is done, and WAIT says none confirmed it (the store refuses to
        # acknowledge: policy_service.durability, test_policy_failover.py).
        assert await batcher.run(SHA, ["wait"], [2]) == (2, 0)
