"""The HTTP front's server: uvicorn on the gateway's own event loop.

`HttpServer.start(config, app)` binds the port (0 picks one; `port` says which) and serves
until `stop()`, which stops accepting, lets open responses finish for up to
`shutdown_grace_s` and then closes them. uvicorn's signal handling is not used: the gateway
process owns SIGINT/SIGTERM and stops this server with the gRPC one. With
`ssl_certfile`/`ssl_keyfile` in the config it serves HTTPS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from fastapi import FastAPI

from services.gateway.config import HttpConfig

log = logging.getLogger(__name__)


class HttpServer:
    """A started uvicorn server."""

    def __init__(self, config: HttpConfig, server: uvicorn.Server, sock: socket.socket,
                 task: asyncio.Task[None]) -> None:
        self.config = config
        self._server = server
        self._socket = sock
        self._task = task
        self.port: int = sock.getsockname()[1]

    @property
    def url(self) -> str:
        scheme = "https" if self.config.ssl_certfile else "http"
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{scheme}://{host}:{self.port}"

    @classmethod
    async def start(cls, config: HttpConfig, app: FastAPI) -> HttpServer:
        settings = uvicorn.Config(
            app, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=int(config.shutdown_grace_s),
            ssl_certfile=str(config.ssl_certfile) if config.ssl_certfile else None,
            ssl_keyfile=str(config.ssl_keyfile) if config.ssl_keyfile else None,
        )
        settings.load()
        sock = _bind(config.host, config.port)
        server = uvicorn.Server(settings)
        server.lifespan = settings.lifespan_class(settings)  # what Server.serve() would set up
        try:
            await server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            raise
        task = asyncio.create_task(server.main_loop(), name="http-front")
        started = cls(config, server, sock, task)
        log.info("OpenAI-compatible HTTP front on %s", started.url)
        return started

    async def stop(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._server.shutdown(sockets=[self._socket])
        self._socket.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
