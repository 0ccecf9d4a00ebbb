"""uvicorn on the daemon's own event loop, its socket bound before the models load.

uvicorn's `Server.serve` would take over SIGINT and SIGTERM; the daemon owns
those (they start its drain), so this server leaves them alone and stops when
the daemon says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from specpage.config import Config
from specpage.models.fetch import hugging_face_id
from specpage.serve.frontend import Frontend
from specpage.serve.metrics import Metrics
from specpage.serve.openai_api.app import build_app
from specpage.serve.openai_api.served import Served
from specpage.serve.startup import StartupError

log = logging.getLogger("specpage.http")
# Seconds the server waits for open connections once the daemon has drained:
# streams in flight have ended by then, so only idle keep-alive ones are left.
CLOSE_GRACE_S = 1


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the daemon's handlers stay: they drain both fronts


class HTTPListener:
    """A bound socket; `start` serves app on it, `stop` closes it."""

    def __init__(self, host: str, port: int, tls: tuple[str, str] | None) -> None:
        self.host = host
        self.tls = tls
        self.socket = _bind(host, port)
        self.port = int(self.socket.getsockname()[1])
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, app: ASGIApp) -> None:
        cert, key = self.tls if self.tls is not None else (None, None)
        config = uvicorn.Config(
            app, lifespan="off", log_config=None, access_log=False, ssl_certfile=cert,
            ssl_keyfile=key, timeout_graceful_shutdown=CLOSE_GRACE_S, server_header=False)
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[self.socket]), name="http")

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            self.socket.close()
            return
        self._server.should_exit = True
        await self._task


def start_http(config: Config, frontend: Frontend, metrics: Metrics | None,
               token: str | None) -> HTTPListener | None:
    """Bind server.http_port and serve the API (None when it is off); metrics
    given, /metrics too."""
    s = config.server
    if s.http_port is None:
        return None
    tls = (s.tls_cert, s.tls_key) if s.tls_cert and s.tls_key else None
    listener = HTTPListener(s.http_host, s.http_port, tls)
    listener.start(build_app(frontend, served(config), metrics, token))
    return listener


def served(config: Config) -> Served:
    """The names the API answers to (server.served_model_name, else the target
    as configured and its checkpoint's Hugging Face id where its metadata has
    one) and the checkpoint each model object names as its root."""
    target = config.model.target
    hub_id = hugging_face_id(target)
    names = config.server.served_model_names or tuple(
        dict.fromkeys(name for name in (target, hub_id) if name))
    root = target if Path(target).exists() or hub_id is None else hub_id
    return Served(names, root, config.model.draft, config.server.max_prompt_tokens,
                  created=int(time.time()))


def _bind(host: str, port: int) -> socket.socket:
    bare = host.removeprefix("[").removesuffix("]")
    try:
        family = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except (socket.gaierror, OSError) as error:
        raise StartupError(f"HTTP address {host}:{port}: {error.strerror}") from None
    try:
        # As uvicorn does, so that connections in TIME_WAIT do not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bare, port))
        sock.listen(socket.SOMAXCONN)
        sock.set_inheritable(True)
    except OSError as error:
        sock.close()
        raise StartupError(f"HTTP port {port} on {host}: {error.strerror}") from None
    return sock
