"""Where the commands show pagedkv's log: stderr, one line a record, as vLLM's commands do.

Start-up says what it is doing (the CPU and the dtype chosen, the attention backend, reading
weights, building the model, the KV cache's size), then each command prints its own output.

One record is one line, whatever a client sends: :class:`SafeFormatter` escapes the control
characters of the message (a request field named ``"x\\nERROR ... FORGED"`` cannot write a line
of its own), and :func:`summarize_for_log` bounds what one request's names add to the log.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable

from pagedkv.errors import ConfigError

#: Values of ``--log-level``.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


#: What :func:`escape_control_chars` escapes: C0 controls (newline, carriage return, ESC...), DEL,
#: C1 controls (U+0085 NEL among them) and the Unicode line / paragraph separators.
_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    named = {0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}.get(code)
    if named is not None:
        return named
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_control_chars(text: str) -> str:
    """``text`` with every control character written as an escape (``\\n``, ``\\r``,
    ``\\t``, ``\\x1b``, ``\\x85``, ``\\u2028``...), so that it prints on one line and
    cannot move the cursor or recolour a terminal."""
    return _CONTROL_CHARS.sub(_escape, text) if _CONTROL_CHARS.search(text) else text


class SafeFormatter(logging.Formatter):
    """A formatter whose records print on one line each: the formatted message (level, time,
    logger name, message) has its control characters escaped (:func:`escape_control_chars`),
    so text that came from a client cannot start a forged line of its own. A traceback, which
    the formatter adds itself after the message, keeps its newlines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_control_chars(super().formatMessage(record))


def summarize_for_log(names: Iterable[str], max_items: int = 10, max_chars: int = 64) -> str:
    """``names`` joined by ", " for one log line of bounded size: the first ``max_items``
    names, each cut to ``max_chars`` characters (``...`` marks a cut), then ``... and N more``.
    At most about ``max_items * (max_chars + 5) + 20`` characters, however many names a client
    sent. Control characters are left to :class:`SafeFormatter`.

    Raises:
        ConfigError: ``max_items`` or ``max_chars`` below 1.
    """
    if max_items < 1 or max_chars < 1:
        raise ConfigError(f"max_items and max_chars must be >= 1, got {max_items}, {max_chars}")
    shown: list[str] = []
    num_more = 0
    for name in names:
        if len(shown) == max_items:
            num_more += 1
            continue
        name = str(name)
        shown.append(name if len(name) <= max_chars else name[:max_chars] + "...")
    text = ", ".join(shown)
    return f"{text} ... and {num_more} more" if num_more else text


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
    """Show the ``pagedkv`` logger's records at ``level`` and above on stderr, one line each
    (:class:`SafeFormatter`; idempotent: one handler however often it is called).

    Args:
        level: one of :data:`LOG_LEVELS`.
    """
    package_logger = logging.getLogger("pagedkv")
    if not any(isinstance(h, _CurrentStderrHandler) for h in package_logger.handlers):
        handler = _CurrentStderrHandler()
        handler.setFormatter(SafeFormatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
    package_logger.setLevel(level.upper())
