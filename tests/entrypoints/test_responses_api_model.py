"""The Responses API on the real default model (SmolLM2-135M) served by a real ``pagedkv serve``
subprocess with the tool-calling flags docs/server.md gives (``--chat-template
examples/tool_chat_template_hermes.jinja --enable-auto-tool-choice --tool-call-parser hermes``),
driven by the clients people use: the openai client (plain, streamed, a forced function call and
its output fed back, a named function, ``text.format`` json_schema, ``previous_response_id``),
the OpenAI Agents SDK (a one-tool agent run to its end), LangChain's ``ChatOpenAI`` with
``use_responses_api`` and litellm's ``responses``. The tiny model's words mean little: the tests
check structure (a call's arguments valid by its schema, a run that ends) and exact values the
server computes (token counts, the conversation a continuation renders)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from _serve_process import serve_process

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).parents[2] / "examples" / "tool_chat_template_hermes.jinja"
MAX_TOKENS = 24
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": PARAMETERS,
}


@pytest.fixture(scope="module")
def served():
    """(base URL, served model name): one ``pagedkv serve smollm2`` for the module."""
    from pagedkv.errors import ModelLoadError
    from pagedkv.model.loader import resolve_model

    try:
        resolve_model("smollm2")
    except ModelLoadError as exc:
        pytest.skip(f"default model not installed: {exc}")
    args = ["smollm2", "--max-model-len", "2048", "--chat-template", str(TEMPLATE)]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    args += ["--disable-log-stats", "--log-level", "warning"]
    with serve_process(args) as (url, _output):
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        yield url, name


@pytest.fixture(scope="module")
def client(served):
    url, _ = served
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def prompt_tokens(served, messages: list[dict]) -> int:
    """The prompt tokens the chat template makes of ``messages`` (/tokenize)."""
    url, name = served
    body = {"model": name, "messages": messages}
    return httpx.post(url + "/tokenize", json=body).json()["count"]


def test_plain_and_streamed_responses(served, client):
    _, name = served
    kwargs = {"model": name, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    whole = client.responses.create(input="Name a color.", instructions="Answer briefly.", **kwargs)
    assert whole.id.startswith("resp_") and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.usage.output_tokens <= MAX_TOKENS
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a color."},
    ]
    assert whole.usage.input_tokens == prompt_tokens(served, messages)
    # A message list is the same conversation; streamed, its deltas join to the same greedy text.
    items = [
        {"role": "system", "content": "Answer briefly."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Name a color."}],
        },
    ]
    kinds, deltas = [], []
    for event in client.responses.create(input=items, stream=True, **kwargs):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        final = event
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert final.sequence_number == len(kinds) - 1
    assert "".join(deltas) == final.response.output_text == whole.output_text


def test_a_forced_function_call_and_its_output_fed_back(client, served):
    _, name = served
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(
        model=name,
        input=[question],
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    # The call and its output fed back; the model answers in text (tool_choice none).
    items = [question, *[c.model_dump(exclude_none=True) for c in calls]]
    items += [
        {"type": "function_call_output", "call_id": c.call_id, "output": '{"celsius": 21}'}
        for c in calls
    ]
    second = client.responses.create(
        model=name,
        input=items,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert [item.type for item in second.output] == ["message"] and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_named_function(client, served):
    _, name = served
    response = client.responses.create(
        model=name,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0,
    )
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)


def test_text_format_json_schema(client, served):
    _, name = served
    schema = {
        "type": "object",
        "properties": {
            "sky": {"type": "string", "enum": ["clear", "cloudy", "rain"]},
            "windy": {"type": "boolean"},
        },
        "required": ["sky", "windy"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=name,
        input="Describe the weather as JSON.",
        text={
            "format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}
        },
        max_output_tokens=64,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_previous_response_id_continues(client, served):
    _, name = served
    kwargs = {"model": name, "max_output_tokens": 8, "temperature": 0}
    first = client.responses.create(input="Say hello.", **kwargs)
    second = client.responses.create(input="Again.", previous_response_id=first.id, **kwargs)
    messages = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Again."},
    ]
    assert second.usage.input_tokens == prompt_tokens(served, messages)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_refused_fields_name_themselves(client, served):
    _, name = served
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=name, input="Hi", **body)
        assert caught.value.body["param"] == param


def test_an_openai_agent_runs_its_tool_to_the_end(served):
    agents = pytest.importorskip("agents")
    url, name = served
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"21 C and clear in {city}"

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model=name, openai_client=client)
        agent = agents.Agent(
            name="weather",
            instructions="Use the tool, then answer.",
            tools=[get_weather],
            model=model,
            # The first turn must call the tool; the SDK then resets tool_choice to auto.
            model_settings=agents.ModelSettings(
                tool_choice="required", max_tokens=48, temperature=0
            ),
        )
        try:
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls and all(isinstance(city, str) and city for city in calls)
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)


def test_langchain_chat_openai_with_the_responses_api(served):
    langchain_openai = pytest.importorskip("langchain_openai")
    url, name = served
    llm = langchain_openai.ChatOpenAI(
        model=name,
        base_url=url + "/v1",
        api_key="unused",
        use_responses_api=True,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )
    message = llm.invoke("Name a color.")
    assert message.text and message.response_metadata["id"].startswith("resp_")
    assert message.usage_metadata["output_tokens"] <= MAX_TOKENS


def test_litellm_responses(served, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before the import: no network
    litellm = pytest.importorskip("litellm")
    url, name = served
    response = litellm.responses(
        model=f"openai/{name}",
        api_base=url + "/v1",
        api_key="unused",
        input="Name a color.",
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
    text = "".join(
        part.text for item in response.output if item.type == "message" for part in item.content
    )
    assert text and response.usage.output_tokens <= MAX_TOKENS
