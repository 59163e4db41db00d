"""What every tool-call parser shares: the call, the result, and the stream that holds back
whitespace-only content (see :class:`ToolCallStream`)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made.

    Attributes:
        name: the function's name (non-empty).
        arguments: the arguments as JSON text of an object (OpenAI's ``function.arguments``).
    """

    name: str
    arguments: str


#: What a stream yields: content text, or a complete tool call.
StreamEvent = str | ToolCall


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A whole output, parsed.

    Attributes:
        content: the text that is not a tool call; None when there is none (or only whitespace).
        tool_calls: the calls, in the order the model wrote them.
    """

    content: str | None
    tool_calls: list[ToolCall]


def read_call(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """``{"name": str, <one of argument_keys>: object}`` -> a ToolCall; None if it is not one.
    Arguments given as a JSON string of an object are accepted too (some models write that)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False))


class ToolCallStream(ABC):
    """Turns text deltas into content and tool calls, one output at a time.

    Content that is only whitespace is held back until text follows it; what is still held when
    the output ends is dropped if the output made a call, else sent (so ``"\\n<tool_call>..."``
    gives no content, and plain text comes back unchanged).
    """

    def __init__(self) -> None:
        self._pending_space = ""
        self._num_calls = 0

    @abstractmethod
    def feed(self, delta: str) -> list[StreamEvent]:
        """The events ``delta`` completes (content and calls, in order)."""

    @abstractmethod
    def finish(self) -> list[StreamEvent]:
        """The events of what is still held, once the output has ended."""

    # ---- helpers for subclasses ---------------------------------------------------------------

    def _content(self, text: str, events: list[StreamEvent]) -> None:
        if not text:
            return
        if not text.strip():
            self._pending_space += text
            return
        events.append(self._pending_space + text)
        self._pending_space = ""

    def _call(self, call: ToolCall, events: list[StreamEvent]) -> None:
        self._num_calls += 1
        events.append(call)

    def _end(self, events: list[StreamEvent]) -> list[StreamEvent]:
        if self._pending_space and not self._num_calls:
            events.append(self._pending_space)
        self._pending_space = ""
        return events


class ToolParser(ABC):
    """A format of tool calls (one instance serves any number of outputs)."""

    #: the ``--tool-call-parser`` name.
    name: str = ""

    @abstractmethod
    def streamer(self) -> ToolCallStream:
        """A fresh stream for one output."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and tool calls of a whole output (the stream over all of it)."""
        stream = self.streamer()
        events = stream.feed(text) + stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        calls = [e for e in events if isinstance(e, ToolCall)]
        return ExtractedToolCalls(content if content.strip() else None, calls)
