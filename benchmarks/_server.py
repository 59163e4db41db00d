"""Start a `pagedkv serve` of the benchmarks' own on a free loopback port, and stop it after.

Shared by ``bench_serving.py``, ``soak_server.py`` and ``bench_chat_latency.py`` (whose
llama-server start-up uses :func:`wait_healthy` and :func:`stop`); benchmark scripts import it from
their own folder, which Python puts first on ``sys.path`` when a script runs.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import httpx


class RunningServer(NamedTuple):
    """The server's base URL (``http://127.0.0.1:PORT``) and process id."""

    url: str
    pid: int


@contextlib.contextmanager
def own_server(
    server_args: list[str],
    startup_timeout: float,
    *,
    log_level: str = "warning",
    echo: bool = True,
    env: Mapping[str, str] | None = None,
) -> Iterator[RunningServer]:
    """Run ``pagedkv serve --host 127.0.0.1 --port 0 --log-level LOG_LEVEL SERVER_ARGS...``.

    Args:
        server_args: extra ``pagedkv serve`` arguments.
        startup_timeout: seconds to wait for ``listening on`` and a 200 from ``/health``.
        log_level: the server's log level.
        echo: copy the server's output to stderr (else it is read and dropped, so that a chatty
            server never blocks on a full pipe).
        env: the server's environment (None: this process's).

    Raises:
        RuntimeError: the server did not start or never answered ``/health`` in time.
    """
    command = [
        sys.executable,
        "-m",
        "pagedkv.entrypoints.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-level",
        log_level,
        *server_args,
    ]
    print("starting:", shlex.join(command), file=sys.stderr, flush=True)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env=None if env is None else dict(env)
    )
    try:
        url = None
        deadline = time.monotonic() + startup_timeout
        stdout = process.stdout
        if stdout is None:
            raise RuntimeError("the server's output is not readable")
        for line in stdout:
            if echo:
                print("  server:", line.rstrip(), file=sys.stderr, flush=True)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                url = match.group(1)
                break
            if time.monotonic() > deadline:
                break
        if url is None:
            raise RuntimeError("the server did not start (see its output above)")
        # Keep reading its output so that a chatty server never blocks on a full pipe.
        threading.Thread(target=_drain, args=(stdout, echo), daemon=True).start()
        wait_healthy(url, deadline)
        yield RunningServer(url, process.pid)
    finally:
        stop(process)


def _drain(stream, echo: bool) -> None:
    for line in stream:
        if echo:
            print("  server:", line.rstrip(), file=sys.stderr, flush=True)


def wait_healthy(
    url: str,
    deadline: float,
    *,
    process: subprocess.Popen | None = None,
    log_tail: Callable[[], str] = lambda: "",
    poll_s: float = 0.2,
) -> None:
    """Poll ``URL/health`` every ``poll_s`` s until it answers 200.

    Args:
        url: the server's base URL.
        deadline: a ``time.monotonic()`` time to give up at.
        process: the server's process, if ours: its exit ends the wait at once.
        log_tail: the tail of the server's log, for the error message.

    Raises:
        RuntimeError: the process exited, or ``/health`` never answered 200 by ``deadline``.
    """
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({process.returncode}):\n{log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health never answered 200:\n{log_tail()}")
        time.sleep(poll_s)


def stop(process: subprocess.Popen, grace_s: float = 30) -> None:
    """Terminate ``process``; kill it if it has not exited after ``grace_s`` seconds."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
