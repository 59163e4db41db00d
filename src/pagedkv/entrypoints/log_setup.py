"""Where the commands show pagedkv's log: stderr, one line a record, as vLLM's commands do.

Start-up says what it is doing (the CPU and the dtype chosen, the attention backend, reading
weights, building the model, the KV cache's size), then each command prints its own output.
"""

from __future__ import annotations

import logging
import sys

#: Values of ``--log-level``.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class _CurrentStderrHandler(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is when a record is emitted (a handler
    that kept the stream it was made with would write to a closed or swapped one under pytest's
    capture, or after a caller redirects stderr)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(level: str = "info") -> None:
    """Show the ``pagedkv`` logger's records at ``level`` and above on stderr (idempotent: one
    handler however often it is called).

    Args:
        level: one of :data:`LOG_LEVELS`.
    """
    package_logger = logging.getLogger("pagedkv")
    if not any(isinstance(h, _CurrentStderrHandler) for h in package_logger.handlers):
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
    package_logger.setLevel(level.upper())


def summarize_for_log(names: list[str], max_items: int = 10, max_chars: int = 64) -> str:
    """``names`` joined for one log line, bounded: at most ``max_items`` names of at most
    ``max_chars`` characters each (client input: a request adds a bounded number of bytes)."""
    shown = [n if len(n) <= max_chars else n[:max_chars] + "..." for n in names[:max_items]]
    more = f" ... and {len(names) - max_items} more" if len(names) > max_items else ""
    return ", ".join(shown) + more
