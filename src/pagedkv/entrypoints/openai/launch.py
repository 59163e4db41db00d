"""Running the app under uvicorn on a socket we bind ourselves, and shutting it down gently.

Binding first (port 0 = any free port) and handing the socket to uvicorn means the caller knows
the real port before the server starts, with no race between "find a free port" and "bind it".

A shutdown (SIGTERM, Ctrl-C, or ``should_exit``) drains (:class:`DrainingServer`): the server
stops accepting connections at once, lets the requests in the engine finish for up to
``shutdown_timeout`` seconds (vLLM's ``--shutdown-timeout``), then fails the rest through the
engine loop's ``fail_streams``: a stream gets an error event (503, "the server is shutting
down") and ``data: [DONE]``, a non-streamed request a 503, and their engine requests are
aborted. Only then does uvicorn's own graceful shutdown run (responses finish, connections
close, the app's lifespan stops the engine thread), so no request is cut off mid-response.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from pagedkv.engine.engine_loop import EngineDeadError, EngineLoop
from pagedkv.entrypoints.openai.server_options import DEFAULT_SHUTDOWN_TIMEOUT
from pagedkv.errors import ConfigError

logger = logging.getLogger(__name__)

#: What the requests still running at the shutdown deadline fail with.
SHUTTING_DOWN = "the server is shutting down"


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: the OS picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: proto must be IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY only on such sockets,
    # and without it Nagle's algorithm plus delayed ACKs add ~40 ms to every small response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose shutdown drains first (see the module docstring).

    Args:
        config: uvicorn's config; ``config.app`` is the app.
        shutdown_timeout: seconds to wait for running engine requests before failing them
            (0: fail them at once).
        engine_loop: what holds the engine requests (``num_streams``, ``fail_streams(exc)``:
            :class:`pagedkv.engine.engine_loop.EngineLoop` or the cluster's); default
            ``app.state.engine_client`` as :func:`create_app` sets it. An app without
            one shuts down as plain uvicorn does.

    Raises:
        ConfigError: a negative or infinite ``shutdown_timeout``.
    """

    def __init__(
        self, config: uvicorn.Config, *, shutdown_timeout: float, engine_loop: Any = None
    ) -> None:
        if not 0 <= shutdown_timeout < float("inf"):
            raise ConfigError(
                f"--shutdown-timeout must be a finite number of seconds >= 0, "
                f"got {shutdown_timeout!r}"
            )
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._engine_loop = engine_loop

    @property
    def engine_loop(self) -> Any:
        if self._engine_loop is not None:
            return self._engine_loop
        return getattr(getattr(self.config.app, "state", None), "engine_client", None)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.drain(sockets)
        await super().shutdown(sockets=sockets)

    async def drain(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop listening and close idle connections, wait until no engine request is open or
        ``shutdown_timeout`` has passed (a second Ctrl-C stops waiting), then fail the rest."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        # Idle keep-alive connections close now; busy ones once their response is sent.
        for connection in list(self.server_state.connections):
            connection.shutdown()
        loop = self.engine_loop
        if loop is None:
            return
        if isinstance(loop, EngineLoop):
            loop.close_kv_listeners()  # /kv event streams never end by themselves
        deadline = time.monotonic() + self.shutdown_timeout
        if loop.num_streams and self.shutdown_timeout > 0:
            logger.info(
                "shutting down: waiting up to %g s for the running requests (%d, "
                "--shutdown-timeout)",
                self.shutdown_timeout,
                loop.num_streams,
            )
        while loop.num_streams and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if loop.num_streams:
            logger.warning(
                "shutting down: failing the requests still running (%d, --shutdown-timeout %g s)",
                loop.num_streams,
                self.shutdown_timeout,
            )
            loop.fail_streams(EngineDeadError(SHUTTING_DOWN))


def make_server(
    app: Any,
    *,
    log_level: str = "warning",
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    engine_loop: Any = None,
    **config: Any,
) -> DrainingServer:
    """A uvicorn server for ``app`` that drains on shutdown (:class:`DrainingServer`, with
    ``shutdown_timeout`` seconds and ``engine_loop``): keep-alive long enough for benchmark
    clients, and after the drain at most 5 s of uvicorn's graceful shutdown (responses being
    sent) before what is left is cancelled.

    Raises:
        ConfigError: a negative or infinite ``shutdown_timeout``.
    """
    config = {"timeout_keep_alive": 30, "timeout_graceful_shutdown": 5, **config}
    return DrainingServer(
        uvicorn.Config(app, log_level=log_level, **config),
        shutdown_timeout=shutdown_timeout,
        engine_loop=engine_loop,
    )


class ThreadedServer:
    """A uvicorn server running ``app`` in a background thread, for tests and benchmarks.

    ::

        with ThreadedServer(app) as server:
            httpx.get(server.url + "/health")

    Args:
        app: the ASGI app.
        host: the address to bind; loopback by default.
        port: the port to bind; 0 picks a free one (``self.port`` says which).
        shutdown_timeout: seconds :meth:`stop` (or ``self.server.handle_exit(SIGTERM, None)``)
            lets running requests finish before failing them; 5 by default, short for tests.
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        shutdown_timeout: float = 5.0,
    ) -> None:
        self.socket = bind_socket(host, port)
        self.host = host
        self.port = self.socket.getsockname()[1]
        self.server = make_server(app, log_level=log_level, shutdown_timeout=shutdown_timeout)
        # uvicorn installs signal handlers only in the main thread; nothing to undo here.
        self._thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.socket]},
            daemon=True,
            name="pagedkv-uvicorn",
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ThreadedServer:
        """Start serving; returns once the server (and the app's lifespan) is up."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the server to exit and wait for it (the app's lifespan shutdown runs)."""
        self.server.should_exit = True
        self._thread.join(timeout)
        self.socket.close()

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
