"""A bare frame echo in a process of its own (`python -m policy_service.frame_echo`): each
frame it reads on a free loopback port goes straight back. `kvrelay bench policy` times a
round trip to it, the floor of any framed call between two Python processes on the host (no
session, no policy code, no Redis), beside the direct Redis script whose round trip it
resembles. It prints `ready PORT` once listening and stops when its stdin closes."""

from __future__ import annotations

import asyncio
import contextlib
import sys

from services.policy.framing import HEADER, STREAM_LIMIT, FrameError, read_frame

MAX_FRAME_BYTES = 1 << 16


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(FrameError, ConnectionError):
        while (data := await read_frame(reader, MAX_FRAME_BYTES)) is not None:
            writer.write(HEADER.pack(len(data)) + data)
            await writer.drain()
    writer.close()


async def serve() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0, limit=STREAM_LIMIT)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes


if __name__ == "__main__":
    asyncio.run(serve())
