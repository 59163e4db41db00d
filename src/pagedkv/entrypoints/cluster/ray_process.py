"""How ``pagedkv serve --data-parallel-size N`` runs Ray in its own process: a local Ray whose
servers listen on loopback, and a SIGTERM that stops the cluster as Ctrl-C does.

- :func:`loopback_ray`: Ray picks the node address its servers (GCS, raylet, workers,
  the dashboard and runtime-env agents) listen on when it is imported; with
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` it is 127.0.0.1, the address Ray uses by default on
  macOS and Windows, where it runs single-node clusters only. A local cluster (no
  ``--ray-address``) is single-node, so it takes that address; a joined one keeps Ray's.
- :class:`SigtermAsInterrupt`: Python's default SIGTERM action (and the handler Ray installs in
  ``ray.init``) ends the process at once, skipping ``finally`` blocks: Ray's agents were left
  running, listening, with no parent. The handler raises :class:`KeyboardInterrupt` in the main
  thread instead, so ``ray.shutdown()`` runs and stops every process Ray started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

#: Ray's switch for single-node, loopback-only clusters (read once, when Ray is imported).
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_ray(ray_address: str | None) -> Iterator[bool]:
    """Around the start of a local Ray (``ray_address`` None), from before Ray is imported:
    its servers listen on 127.0.0.1.

    Sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in this process's environment, which Ray reads
    when imported and its processes inherit when started, and removes it on exit. Yields whether
    Ray will use loopback: False when joining a cluster, when the user set the variable, or
    when Ray was already imported in this process (too late: its address was chosen).
    """
    if ray_address is not None or RAY_LOOPBACK_ENV in os.environ:
        yield os.environ.get(RAY_LOOPBACK_ENV) == "0" and ray_address is None
        return
    os.environ[RAY_LOOPBACK_ENV] = "0"
    try:
        yield "ray._private.ray_constants" not in sys.modules
    finally:
        os.environ.pop(RAY_LOOPBACK_ENV, None)


class SigtermAsInterrupt:
    """While active, SIGTERM raises :class:`KeyboardInterrupt` in the main thread (once: a
    second SIGTERM ends the process at once, as by default). On exit the handler that was there
    before is put back (the default action if it was not a Python one, such as Ray's).

    Call :meth:`install` again after something replaced the handler (``ray.init``). Does
    nothing outside the main thread (Python allows handlers there only).
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self._active = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt(f"signal {signum}")

    def install(self) -> None:
        """(Re)install the handler."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.signal(signal.SIGTERM, self._handle)
        if not self._active:
            self._previous = previous
            self._active = True

    def __enter__(self) -> SigtermAsInterrupt:
        self.install()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._active:
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, previous)
            self._active = False
