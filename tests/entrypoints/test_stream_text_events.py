"""A streamed chat's plain text events are written from a template rendered once per choice
(StreamWriter.text_event: the served path's cost per token, issue 49): byte for byte the events
the response models give, and the model path still for every other chunk."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedkv.engine.input_processor import ProcessedPrompt
from pagedkv.entrypoints.openai.protocol.responses import ChatChunkChoice, DeltaMessage
from pagedkv.entrypoints.openai.serving_chat import ChatResponseWriter
from pagedkv.entrypoints.openai.serving_engine import Options, PromptState, Sample
from pagedkv.entrypoints.openai.tool_calling import ToolChoice

TEXTS = ["Hello", " world", 'a "quoted" \\ back', "line\nbreak\ttab", "é 中文 🙂", "\x00", " "]


def _writer(options: Options | None = None, model: str = "smollm2") -> ChatResponseWriter:
    prompt = PromptState("r0", [Sample(0), Sample(1)], ProcessedPrompt([1, 2, 3], "hi"))
    return ChatResponseWriter("chatcmpl-1", model, [prompt], options or Options(), ToolChoice())


def _model_event(writer: ChatResponseWriter, index: int, text: str) -> str:
    return writer.choice_event(ChatChunkChoice(index=index, delta=DeltaMessage(content=text)))


@pytest.mark.parametrize("text", TEXTS)
def test_a_text_event_is_the_models_event_byte_for_byte(text):
    writer = _writer()
    for index in (0, 1):
        event = writer.chunks(writer.prompts[0], writer.prompts[0].samples[index], text, 1, None)
        assert event == [_model_event(writer, index, text)]
    body = json.loads(event[0].removeprefix("data: "))
    assert body["choices"] == [{"index": 1, "delta": {"content": text}, "finish_reason": None}]
    assert body["id"] == "chatcmpl-1" and body["model"] == "smollm2"


def test_the_template_is_rendered_once_per_choice():
    writer = _writer()
    sample = writer.prompts[0].samples[0]
    for text in TEXTS:
        writer.chunks(writer.prompts[0], sample, text, 1, None)
    assert list(writer._text_templates) == [0]


def test_a_name_holding_the_placeholder_takes_the_model_path():
    from pagedkv.entrypoints.openai.serving_engine import _TEXT_SLOT

    writer = _writer(model=_TEXT_SLOT)  # its JSON string appears twice in the event
    sample = writer.prompts[0].samples[0]
    assert writer.chunks(writer.prompts[0], sample, "x", 1, None) == [_model_event(writer, 0, "x")]
    assert writer._text_templates == {0: None}


@pytest.mark.parametrize(
    "options", [Options(continuous_usage=True), Options(logprobs=None, include_usage=True)]
)
def test_usage_options_keep_their_events(options):
    writer = _writer(options)
    sample = writer.prompts[0].samples[0]
    sample.token_ids = [7]
    (event,) = writer.chunks(writer.prompts[0], sample, "x", 1, None)
    assert event == _model_event(writer, 0, "x")
    has_usage = "usage" in json.loads(event.removeprefix("data: "))
    assert has_usage == options.continuous_usage


def test_the_last_chunk_still_carries_the_finish_reason():
    writer = _writer()
    sample = writer.prompts[0].samples[0]
    events = writer.chunks(writer.prompts[0], sample, "end", 1, "length")
    assert [json.loads(e.removeprefix("data: "))["choices"][0] for e in events] == [
        {"index": 0, "delta": {"content": "end"}, "finish_reason": None},
        {"index": 0, "delta": {}, "finish_reason": "length"},
    ]


@settings(max_examples=300, derandomize=True, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=1))
@example(text="\x7f\u2028\u2029\ufffd\x1f")
def test_any_text_event_is_the_models_event(text):
    """Any text a detokenizer can give (every code point but lone surrogates): the template's
    JSON string is the response model's, byte for byte."""
    writer = _writer()
    sample = writer.prompts[0].samples[0]
    assert writer.chunks(writer.prompts[0], sample, text, 1, None) == [
        _model_event(writer, 0, text)
    ]
