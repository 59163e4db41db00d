"""Hermes-style tool calls (Hermes 2 Pro, Qwen 2.5 / 3, and the template in examples/):
``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number, text around them.

A block whose JSON is not a call comes back as content, verbatim (tags included); an unclosed
block at the end of the output (the model stopped before ``</tool_call>``) is read too.
"""

from __future__ import annotations

import json

from pagedkv.entrypoints.openai.tool_parsers.base import (
    StreamEvent,
    ToolCall,
    ToolCallStream,
    ToolParser,
    read_call,
)

START = "<tool_call>"
END = "</tool_call>"


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that starts ``marker`` (it may be the marker)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _parse_block(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return read_call(obj, ("arguments", "parameters"))


class _HermesStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._inside = False

    def feed(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        self._buffer += delta
        while True:
            if not self._inside:
                at = self._buffer.find(START)
                if at < 0:
                    keep = _held_prefix(self._buffer, START)
                    self._content(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._content(self._buffer[:at], events)
                self._buffer = self._buffer[at + len(START) :]
                self._inside = True
            else:
                at = self._buffer.find(END)
                if at < 0:
                    return events
                self._block(self._buffer[:at], closed=True, events=events)
                self._buffer = self._buffer[at + len(END) :]
                self._inside = False

    def _block(self, body: str, *, closed: bool, events: list[StreamEvent]) -> None:
        call = _parse_block(body)
        if call is None:
            self._content(START + body + (END if closed else ""), events)
        else:
            self._call(call, events)

    def finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._inside:
            self._block(self._buffer, closed=False, events=events)
        else:
            self._content(self._buffer, events)
        self._buffer = ""
        self._inside = False
        return self._end(events)


class HermesToolParser(ToolParser):
    """``--tool-call-parser hermes``."""

    name = "hermes"

    def streamer(self) -> ToolCallStream:
        return _HermesStream()
