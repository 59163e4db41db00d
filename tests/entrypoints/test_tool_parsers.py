"""Tool-call parsers (hermes, llama3_json): whole outputs, several calls, malformed calls as
content, and streams that give the same result however the text is split."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ToolCall,
    get_tool_parser,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'


def args(call: ToolCall) -> dict:
    return json.loads(call.arguments)


def test_hermes_one_call():
    result = get_tool_parser("hermes").extract(f"<tool_call>\n{WEATHER}\n</tool_call>")
    assert result.content is None
    assert [c.name for c in result.tool_calls] == ["get_weather"]
    assert args(result.tool_calls[0]) == {"city": "Paris", "unit": "celsius"}


def test_hermes_several_calls_and_content():
    text = f"Let me check.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{TIME}</tool_call>\n"
    result = get_tool_parser("hermes").extract(text)
    assert result.content == "Let me check.\n"
    assert [c.name for c in result.tool_calls] == ["get_weather", "get_time"]
    assert args(result.tool_calls[1]) == {"tz": "Europe/Paris"}


def test_hermes_unclosed_last_call_is_read():
    result = get_tool_parser("hermes").extract(f"<tool_call>\n{TIME}\n")
    assert [c.name for c in result.tool_calls] == ["get_time"]


def test_hermes_arguments_as_a_json_string_and_parameters_key():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert args(get_tool_parser("hermes").extract(text).tool_calls[0]) == {"x": 1}
    text = '<tool_call>{"name": "f", "parameters": {"y": [1, 2]}}</tool_call>'
    assert args(get_tool_parser("hermes").extract(text).tool_calls[0]) == {"y": [1, 2]}


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "f", "arguments": {</tool_call>',  # bad JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        "<tool_call>[1, 2]</tool_call>",
        "<tool_call>not json at all",
    ],
)
def test_hermes_malformed_call_is_content(block):
    result = get_tool_parser("hermes").extract("Hi " + block)
    assert result.tool_calls == []
    assert result.content == "Hi " + block


def test_hermes_malformed_call_beside_a_good_one():
    text = f"<tool_call>{{oops</tool_call><tool_call>{TIME}</tool_call>"
    result = get_tool_parser("hermes").extract(text)
    assert result.content == "<tool_call>{oops</tool_call>"
    assert [c.name for c in result.tool_calls] == ["get_time"]


def test_plain_text_is_content_unchanged():
    for name in TOOL_PARSERS:
        result = get_tool_parser(name).extract("  The answer is 4.\n")
        assert result.content == "  The answer is 4.\n"
        assert result.tool_calls == []
        assert get_tool_parser(name).extract("  \n").content is None


def test_llama3_json_calls():
    parser = get_tool_parser("llama3_json")
    one = parser.extract('{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert one.content is None
    assert [(c.name, args(c)) for c in one.tool_calls] == [("get_time", {"tz": "UTC"})]
    two = parser.extract(
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": 1}}'
    )
    assert [(c.name, args(c)) for c in two.tool_calls] == [("a", {}), ("b", {"k": 1})]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "a", "parameters": {}} and then some prose',
        '{"not": "a call"}',
        '{"name": "a", "parameters": ',
        "<|python_tag|>print(1)",
    ],
)
def test_llama3_json_malformed_is_content(text):
    result = get_tool_parser("llama3_json").extract(text)
    assert result.tool_calls == []
    assert result.content == text


def streamed(name: str, pieces: list[str]) -> tuple[str | None, list[ToolCall]]:
    stream = get_tool_parser(name).streamer()
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content or None, [e for e in events if isinstance(e, ToolCall)]


def test_stream_one_character_at_a_time():
    text = f"Sure.<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    content, calls = streamed("hermes", list(text))
    assert content == "Sure."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    stream = get_tool_parser("hermes").streamer()
    # Content is sent before the call starts; a partial "<tool_" is held back.
    assert stream.feed("Sure.<tool_") == ["Sure."]
    assert stream.feed("call>" + WEATHER) == []
    assert [e.name for e in stream.feed("</tool_call>")] == ["get_weather"]


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


_fragments = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        WEATHER,
        TIME,
        "<|python_tag|>",
        "{",
        "}",
        ";",
        '"name"',
        "\n",
        " ",
        "text",
        "<tool",
        "é😀",
    ]
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    name=st.sampled_from(sorted(TOOL_PARSERS)),
    parts=st.lists(st.one_of(_fragments, st.text(max_size=8)), max_size=12),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_any_text_any_split_never_raises_and_streams_as_a_whole(name, parts, cuts):
    text = "".join(parts)
    whole = get_tool_parser(name).extract(text)
    content, calls = streamed(name, _pieces(text, cuts))
    assert (content if content and content.strip() else None) == whole.content
    assert calls == whole.tool_calls
    if not calls:  # nothing read as a call: the text comes back verbatim
        assert whole.content == (text if text.strip() else None)
    for call in calls:
        assert call.name and isinstance(json.loads(call.arguments), dict)
