"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole output is ``{"name": "f", "parameters":
{...}}``, or several such objects separated by ``;``, optionally after ``<|python_tag|>``.

Whether an output is a call is known from its first characters (``{`` or ``<|python_tag|>``);
such an output is held to its end and then read: if every object is a call, they are the calls,
else the whole text is content. Any other output streams as content.
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

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls of a whole output, or None if it is not (only) calls."""
    rest = text.strip()
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG) :].lstrip()
    calls: list[ToolCall] = []
    while rest:
        try:
            obj, end = _DECODER.raw_decode(rest)
        except ValueError:
            return None
        call = read_call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
    return calls or None


class _Llama3Stream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._mode: str | None = None  # None: undecided, "calls": held, "content": streamed

    def feed(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._mode == "content":
            self._content(delta, events)
            return events
        self._buffer += delta
        if self._mode is None:
            head = self._buffer.lstrip()
            if not head:
                return events
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._mode = "calls"
            elif PYTHON_TAG.startswith(head):
                return events  # may still become the tag
            else:
                self._mode = "content"
                self._content(self._buffer, events)
                self._buffer = ""
        return events

    def finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        calls = parse_calls(self._buffer) if self._mode == "calls" else None
        if calls is None:
            self._content(self._buffer, events)
        else:
            for call in calls:
                self._call(call, events)
        self._buffer = ""
        return self._end(events)


class Llama3JsonToolParser(ToolParser):
    """``--tool-call-parser llama3_json``."""

    name = "llama3_json"

    def streamer(self) -> ToolCallStream:
        return _Llama3Stream()
