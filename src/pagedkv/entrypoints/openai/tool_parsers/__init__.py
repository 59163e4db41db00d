"""Tool-call parsers: a model's generated text -> OpenAI ``tool_calls`` (vLLM's
``--tool-call-parser``).

::

    parser = get_tool_parser("hermes")
    result = parser.extract(text)          # ExtractedToolCalls(content, tool_calls)
    stream = parser.streamer()
    for delta in text_deltas:
        for event in stream.feed(delta):   # str (content) or ToolCall (a complete call)
            ...
    for event in stream.finish():
        ...

Formats (docs/server.md, "Tool calling"):

- ``hermes`` (Hermes, Qwen 2.5/3, our examples/tool_chat_template_hermes.jinja):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them, with text
  around them as content.
- ``llama3_json`` (Llama 3.1/3.2/3.3): the whole output is ``{"name": ..., "parameters": {...}}``
  (or several separated by ``;``), optionally after ``<|python_tag|>``.

A call the parser cannot read (bad JSON, no name, arguments that are not an object) is never an
error: its text comes back as content. :meth:`ToolParser.extract` is the stream run over the
whole text, so streamed and non-streamed responses agree for any split of the text into
deltas (property-tested).
"""

from __future__ import annotations

from pagedkv.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamEvent,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from pagedkv.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedkv.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

#: ``--tool-call-parser`` name -> parser (vLLM's names).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``.

    Raises:
        KeyError: no parser of that name (the CLI offers the names as choices).
    """
    return TOOL_PARSERS[name]()


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "StreamEvent",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
]
