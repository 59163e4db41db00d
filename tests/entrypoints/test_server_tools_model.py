"""Tool calling on the real default model (SmolLM2-135M, fp32) with our Hermes template
(examples/tool_chat_template_hermes.jinja): the round trip assistant tool call -> tool message ->
final answer through /v1/chat/completions, streamed and not, equal to what the engine generates
greedily for the same rendered prompt, read by the same parser."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from pagedkv.entrypoints.openai.tool_parsers import get_tool_parser

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).parents[2] / "examples" / "tool_chat_template_hermes.jinja"
MAX_TOKENS = 8
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
ROUND_TRIP = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21, "sky": "clear"}'},
]


@pytest.fixture(scope="module")
def engine():
    torch = pytest.importorskip("torch")
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.errors import ModelLoadError
    from pagedkv.model.loader import load_model

    try:
        loaded = load_model(dtype=torch.float32)
    except ModelLoadError as exc:
        pytest.skip(f"default model not installed: {exc}")
    return LLMEngine(dtype="float32", max_model_len=1024, max_num_seqs=4, loaded_model=loaded)


@pytest.fixture(scope="module")
def server(engine):
    from pagedkv.engine.engine_loop import EngineLoop
    from pagedkv.entrypoints.openai.app import create_app
    from pagedkv.entrypoints.openai.chat_options import ChatOptions, load_chat_template
    from pagedkv.entrypoints.openai.launch import ThreadedServer

    options = ChatOptions(
        chat_template=load_chat_template(str(TEMPLATE)),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    app = create_app(EngineLoop(engine), model_name="smollm2", chat_options=options)
    with ThreadedServer(app) as running:
        yield running


def test_template_renders_tools_calls_and_results(server):
    body = {"messages": ROUND_TRIP, "return_token_strs": False}
    ids = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in (
        text
    )
    assert '<tool_response>\n{"celsius": 21, "sky": "clear"}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_round_trip_answer_streamed_and_not(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        kwargs = {
            "model": "smollm2",
            "messages": ROUND_TRIP,
            "tools": [TOOL],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        # tool_choice "none": the same prompt (tools rendered), the raw greedy text.
        raw = client.chat.completions.create(tool_choice="none", **kwargs).choices[0]
        reply = client.chat.completions.create(**kwargs).choices[0]
        streamed_content, streamed_calls = "", {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                streamed_content += choice.delta.content or ""
                for piece in choice.delta.tool_calls or ():
                    entry = streamed_calls.setdefault(piece.index, ["", ""])
                    entry[0] += piece.function.name or ""
                    entry[1] += piece.function.arguments or ""
    assert raw.message.content  # the model answers the tool's result
    expected = get_tool_parser("hermes").extract(raw.message.content)
    assert reply.message.content == expected.content
    calls = [(c.name, c.arguments) for c in expected.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or ()] == (
        calls
    )
    assert (streamed_content or None) == expected.content
    assert [tuple(v) for v in streamed_calls.values()] == calls
    for _, arguments in streamed_calls.values():
        json.loads(arguments)
