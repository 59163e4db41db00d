"""``pagedkv serve`` as a real subprocess for tests: started on a free loopback port, its URL
read from the line it prints, its whole output kept, always stopped."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import pytest


@dataclass
class ServeProcess:
    """A running ``pagedkv serve``: its base URL, its output lines so far (a list that keeps
    growing) and the process (to signal it)."""

    url: str
    output: list[str]
    process: subprocess.Popen


@contextlib.contextmanager
def serve_process(
    args: Sequence[str], env: Mapping[str, str] | None = None, start_timeout: float = 300
) -> Iterator[tuple[str, list[str]]]:
    """Run ``pagedkv serve --port 0 *args``; yields (its base URL, its output lines so far,
    a list that keeps growing). ``start_timeout`` bounds a hung start (seconds between two
    lines), not a speed assumption. Fails the test if the server exits before listening."""
    with start_serve_process(args, env, start_timeout) as served:
        yield served.url, served.output


@contextlib.contextmanager
def serve_subprocess(
    args: Sequence[str], env: Mapping[str, str] | None = None, start_timeout: float = 300
) -> Iterator[tuple[subprocess.Popen, str, list[str]]]:
    """:func:`serve_process` that also yields the process (first), for tests that signal it."""
    with start_serve_process(args, env, start_timeout) as served:
        yield served.process, served.url, served.output


@contextlib.contextmanager
def start_serve_process(
    args: Sequence[str], env: Mapping[str, str] | None = None, start_timeout: float = 300
) -> Iterator[ServeProcess]:
    """:func:`serve_process`, yielding a :class:`ServeProcess` (with the process)."""
    command = [sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--port", "0", *args]
    process = subprocess.Popen(
        command,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def read() -> None:
        for line in process.stdout:
            output.append(line)
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    try:
        url = None
        while url is None:
            line = lines.get(timeout=start_timeout)
            if not line:
                pytest.fail("pagedkv serve exited:\n" + "".join(output))
            if "listening on " in line:
                # "... listening on URL" or, with replicas, "... on URL (2 replicas, ...)"
                url = line.rsplit("listening on ", 1)[1].split()[0]
        yield ServeProcess(url, output, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
