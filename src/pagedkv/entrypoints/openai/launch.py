"""Running the app under uvicorn on a socket we bind ourselves.

Binding first (port 0 = any free port) and handing the socket to uvicorn means the caller knows
the real port before the server starts, with no race between "find a free port" and "bind it".
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


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


def make_server(app: Any, *, log_level: str = "warning", **config: Any) -> uvicorn.Server:
    """A uvicorn server for ``app``: keep-alive long enough for benchmark clients, and at most
    5 s of graceful shutdown so that open streams cannot hold an interrupted server forever."""
    config = {"timeout_keep_alive": 30, "timeout_graceful_shutdown": 5, **config}
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, **config))


class ThreadedServer:
    """A uvicorn server running ``app`` in a background thread, for tests and benchmarks.

    ::

        with ThreadedServer(app) as server:
            httpx.get(server.url + "/health")

    Args:
        app: the ASGI app.
        host: the address to bind; loopback by default.
        port: the port to bind; 0 picks a free one (``self.port`` says which).
    """

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self.socket = bind_socket(host, port)
        self.host = host
        self.port = self.socket.getsockname()[1]
        self.server = make_server(app, log_level=log_level)
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
