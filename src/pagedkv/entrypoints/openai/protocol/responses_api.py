"""OpenAI's Responses API (``POST /v1/responses``): its request, the chat request it becomes, and
its response object and stream events.

A Responses request is a chat request in other words: ``instructions`` is a system message first,
``input`` (a string, or a list of items) the conversation, each ``function_call`` item an
assistant's tool call and each ``function_call_output`` item a tool message;
``max_output_tokens`` is ``max_completion_tokens``, ``text.format`` is ``response_format`` and
the flat function ``tools`` / ``tool_choice`` are chat's nested ones. :meth:`ResponsesRequest.
chat_request` builds that :class:`~.requests.ChatCompletionRequest`, which the chat handler
renders through the chat template and runs (serving_responses.py).

Refused with a 400 naming the field: built-in tools (``web_search``, ``file_search``, ``mcp``...)
and tool choices, input items other than messages and function calls / outputs, content parts
other than text (images, files, audio), and the known fields of ``REFUSED_RESPONSES``
(refusals.py) when they ask for something. Accepted without effect, in the warning line:
``IGNORED_RESPONSES``, ``reasoning.effort`` and ``text.verbosity``.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from pagedkv.entrypoints.openai.protocol.fields import (
    INT64_MIN,
    INTEGRAL,
    MAX_MESSAGES,
    MAX_TOOLS,
    SEED_MAX,
    FiniteFloat,
    Identifier,
    JsonSchema,
    Metadata,
    PositiveInt64,
    PromptCacheRetention,
    Text,
    valid_unicode,
)
from pagedkv.entrypoints.openai.protocol.messages import (
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
)
from pagedkv.entrypoints.openai.protocol.refusals import (
    IGNORED_RESPONSES,
    REFUSED_RESPONSES,
    Refused,
    UnsupportedFieldError,
)
from pagedkv.entrypoints.openai.protocol.requests import ChatCompletionRequest
from pagedkv.entrypoints.openai.protocol.schema import StrictModel
from pagedkv.entrypoints.openai.protocol.structured_outputs import (
    JsonSchemaFormat,
    ResponseFormat,
)

# ---- request -----------------------------------------------------------------------------------

#: The input item types pagedkv reads (an item without ``type`` is a message, as OpenAI's).
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")
#: The content part types of a message (text only).
CONTENT_PART_TYPES = ("input_text", "output_text")

_Name = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(valid_unicode)]


def _json_object_text(value: str) -> str:
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise ValueError(f"not JSON text: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError("not the JSON text of an object")
    return value


class ResponsesInputText(StrictModel):
    """A text part of an input message: ``{"type": "input_text", "text": ...}``."""

    type: Literal["input_text"]
    text: Text


class ResponsesOutputTextIn(StrictModel):
    """A text part of an earlier assistant message fed back (an output item as the response
    gave it: its ``annotations`` and ``logprobs`` are accepted and not read)."""

    type: Literal["output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def by_type(*members: type[StrictModel], default: str | None = None) -> Any:
    """A union of request models told apart by their ``type`` (``default``: the type of an
    item without one). Each member's tag is its class name, so that an error's location names
    the field, not the member (errors.py leaves capitalized parts out of the path it reports)."""
    tags = {
        member.model_fields["type"].annotation.__args__[0]: member.__name__ for member in members
    }

    def tag(value: Any) -> str | None:
        kind = (
            value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        )
        return tags.get(kind) if isinstance(kind, str) else None

    union = Annotated[members[0], Tag(members[0].__name__)]
    for member in members[1:]:
        union = union | Annotated[member, Tag(member.__name__)]
    return Annotated[union, Discriminator(tag)]


ContentPart = by_type(ResponsesInputText, ResponsesOutputTextIn)


class ResponsesMessageItem(StrictModel):
    """A message of the conversation (``type`` "message" may be left out). ``developer`` is a
    system message to the chat template; ``id`` and ``status`` (an output item fed back) are
    accepted and not read."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponsesFunctionCallItem(StrictModel):
    """An earlier call of the assistant's (an output item fed back): an assistant message's
    ``tool_calls`` entry to the chat template."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]
    name: _Name
    #: the JSON text of an object
    arguments: Annotated[str, AfterValidator(valid_unicode), AfterValidator(_json_object_text)]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponsesFunctionCallOutputItem(StrictModel):
    """A call's result (``call_id`` names the call): a ``tool`` message to the chat template."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]
    output: Text | Annotated[list[ResponsesInputText], Field(max_length=MAX_MESSAGES)]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


InputItem = by_type(
    ResponsesMessageItem,
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    default="message",
)


class ResponsesFunctionTool(StrictModel):
    """A function tool, Responses-style (flat): ``{"type": "function", "name", "description",
    "parameters", "strict"}``; as chat's ``tools[i].function``."""

    type: Literal["function"]
    name: _Name
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(StrictModel):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"]
    name: _Name


class ResponsesTextFormatText(StrictModel):
    type: Literal["text"]


class ResponsesTextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class ResponsesTextFormatJsonSchema(StrictModel):
    """``text.format`` of type json_schema: the output follows ``schema`` (``strict`` either
    way: the grammar always holds)."""

    type: Literal["json_schema"]
    name: Text
    json_schema: JsonSchema = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None


class ResponsesTextConfig(StrictModel):
    """``text``: the output's ``format`` (free text, any JSON object, or a JSON Schema) and
    ``verbosity`` (accepted without effect)."""

    format: (
        by_type(
            ResponsesTextFormatText, ResponsesTextFormatJsonObject, ResponsesTextFormatJsonSchema
        )
        | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesReasoning(StrictModel):
    """``reasoning``: ``effort`` is accepted without effect (the model does not reason); a
    ``summary`` is refused."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Any = None
    generate_summary: Any = None


class ResponsesStreamOptions(StrictModel):
    """``stream_options``: ``include_obfuscation`` (no effect: events are not padded)."""

    include_obfuscation: bool | None = None


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``. ``input`` is a string (one user message) or a list of items;
    with ``previous_response_id`` it continues that stored response's conversation (its
    ``instructions`` are not carried over, as OpenAI's). Without ``max_output_tokens`` the reply
    may run to max_model_len."""

    REFUSED: ClassVar[dict[str, Refused]] = REFUSED_RESPONSES
    IGNORED: ClassVar[tuple[str, ...]] = IGNORED_RESPONSES

    model: Text | None = None
    input: Text | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: Text | None = None
    max_output_tokens: PositiveInt64 | None = None
    temperature: Annotated[FiniteFloat, Field(le=2.0)] = 1.0
    top_p: FiniteFloat = 1.0
    #: sample with this seed (vLLM's extra field; reproducible as chat's)
    seed: Annotated[int, Field(ge=INT64_MIN, le=SEED_MAX), INTEGRAL] | None = None
    tools: Annotated[list[ResponsesFunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesTextConfig | None = None
    stream: bool = False
    #: keep the response for ``previous_response_id`` and ``GET /v1/responses/{id}``
    store: bool = True
    previous_response_id: Text | None = None
    # Known fields without effect (IGNORED_RESPONSES) and refused ones (REFUSED_RESPONSES).
    stream_options: ResponsesStreamOptions | None = None
    user: Text | None = None
    metadata: Metadata | None = None
    service_tier: Identifier | None = None
    #: honoured as chat's: the cluster's routing key (sampling_request.py)
    prompt_cache_key: Text | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    safety_identifier: Identifier | None = None
    max_tool_calls: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    include: list[Text] | None = None
    reasoning: ResponsesReasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Any = None
    context_management: Any = None
    background_options: Any = None
    access_programs: Any = None
    image: Any = None
    moderation: Any = None
    prompt_cache_options: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_text_or_functions(cls, data: Any) -> Any:
        """Built-in tools and tool choices, non-text input items and content parts: a 400
        naming the field and what was given (rather than pydantic's list of union members)."""
        if not isinstance(data, dict):
            return data
        tools = data.get("tools")
        if isinstance(tools, list):
            for i, tool in enumerate(tools):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and kind != "function":
                    raise UnsupportedFieldError(
                        "tools",
                        f"`tools[{i}]`: the built-in tool {kind!r} is not available on pagedkv "
                        "(no hosted tools here); only function tools are",
                    )
        choice = data.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise UnsupportedFieldError(
                "tool_choice",
                f"`tool_choice` of type {kind!r} is not available on pagedkv: give "
                '"none", "auto", "required" or {"type": "function", "name": ...}',
            )
        items = data.get("input")
        if isinstance(items, list):
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    continue
                kind = item.get("type", "message")
                if isinstance(kind, str) and kind not in INPUT_ITEM_TYPES:
                    raise UnsupportedFieldError(
                        "input",
                        f"`input[{i}]`: items of type {kind!r} are not supported (only "
                        f"{', '.join(INPUT_ITEM_TYPES)})",
                    )
                parts = item.get("content") if kind == "message" else item.get("output")
                for part in parts if isinstance(parts, list) else ():
                    kind = part.get("type") if isinstance(part, dict) else None
                    if isinstance(kind, str) and kind not in CONTENT_PART_TYPES:
                        raise UnsupportedFieldError(
                            "input",
                            f"`input[{i}]`: only text content is supported (got a content part "
                            f"of type {kind!r})",
                        )
        return data

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedFieldError` (a 400 naming the field) for the first refused
        field that asks for something (``REFUSED``)."""
        for name, refused in self.REFUSED.items():
            value = getattr(self, name)
            if not refused.accepts(value, self):
                shown = (
                    value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
                )
                raise UnsupportedFieldError(name, f"`{name}`: {refused.why} (got {shown!r})")

    def ignored_fields(self) -> list[str]:
        """The names of the known fields set that have no effect (``IGNORED``, and
        ``reasoning.effort`` / ``text.verbosity``)."""
        names = [name for name in self.IGNORED if getattr(self, name) is not None]
        if self.include:
            names.append("include")
        if self.reasoning is not None and self.reasoning.effort is not None:
            names.append("reasoning.effort")
        if self.text is not None and self.text.verbosity is not None:
            names.append("text.verbosity")
        for i, tool in enumerate(self.tools or ()):
            if tool.strict and self.effective_tool_choice == "auto":
                names.append(f"tools[{i}].strict (not enforced under tool_choice auto)")
        return names

    @property
    def effective_tool_choice(self) -> str | ResponsesNamedToolChoice:
        """``tool_choice``, with OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def input_messages(self) -> list[ChatMessage]:
        """``input`` as chat messages (without ``instructions``): a string is one user message;
        consecutive ``function_call`` items join the assistant message before them (or make
        one), each ``function_call_output`` is a ``tool`` message."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        messages: list[ChatMessage] = []
        for item in self.input:
            if isinstance(item, ResponsesMessageItem):
                messages.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, ResponsesFunctionCallItem):
                call = MessageToolCall(
                    id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
                )
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":
                    messages[-1] = ChatMessage(
                        role="assistant",
                        content=last.content,
                        tool_calls=[*(last.tool_calls or ()), call],
                    )
                else:
                    messages.append(ChatMessage(role="assistant", tool_calls=[call]))
            else:
                messages.append(
                    ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text())
                )
        return messages

    def chat_request(self, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request this request is, over ``messages`` (the whole conversation,
        ``instructions`` first). Not yet checked: ``check_supported`` it (its 400s name chat's
        fields: :func:`~pagedkv.entrypoints.openai.serving_responses.responses_error` renames
        them)."""
        tools = None
        if self.tools is not None:
            tools = [
                ChatTool(
                    type="function",
                    function=FunctionDefinition(
                        name=tool.name,
                        description=tool.description,
                        parameters=tool.parameters,
                        strict=tool.strict,
                    ),
                )
                for tool in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, ResponsesNamedToolChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        response_format = None
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, ResponsesTextFormatJsonSchema):
            response_format = ResponseFormat(
                type="json_schema",
                json_schema=JsonSchemaFormat(
                    name=fmt.name,
                    description=fmt.description,
                    schema=fmt.json_schema,
                    strict=fmt.strict,
                ),
            )
        elif fmt is not None:
            response_format = ResponseFormat(type=fmt.type)
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format,
            stream=self.stream,
            prompt_cache_key=self.prompt_cache_key,
        )

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response object repeats them (OpenAI's defaults
        where the request left them out)."""
        fmt = self.text.format if self.text is not None else None
        text: dict[str, Any] = {
            "format": {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True),
        }
        if self.text is not None and self.text.verbosity is not None:
            text["verbosity"] = self.text.verbosity
        # OpenAI reports "auto" for a request that set none, with or without tools
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": {
                "effort": None if self.reasoning is None else self.reasoning.effort,
                "summary": None,
            },
            "store": self.store,
            "temperature": self.temperature,
            "text": text,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [tool.model_dump() for tool in self.tools or ()],
            "top_p": self.top_p,
            "truncation": self.truncation or "disabled",
            "user": self.user,
            "metadata": self.metadata if isinstance(self.metadata, dict) else None,
            "background": False,
        }


def output_messages(text: str | None, calls: list[tuple[str, str, str]]) -> list[ChatMessage]:
    """A response's output as the assistant message the conversation goes on with: its text
    and its calls ``(call_id, name, arguments)``. A call whose arguments are not the JSON text
    of an object (cut by max_output_tokens) stays in the text as written."""
    tool_calls = []
    for call_id, name, arguments in calls:
        try:
            tool_calls.append(
                MessageToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
            )
        except ValueError:
            text = (text or "") + arguments
    if text is None and not tool_calls:
        return []
    return [ChatMessage(role="assistant", content=text, tool_calls=tool_calls or None)]


# ---- response ----------------------------------------------------------------------------------


def response_id() -> str:
    """A fresh response id, ``resp_<32 hex digits>`` (OpenAI's form)."""
    return f"resp_{uuid.uuid4().hex}"


def item_id(prefix: str) -> str:
    """A fresh output item id: ``msg_...`` (a message) or ``fc_...`` (a function call)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ResponsesOutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponsesOutputText]


class ResponsesFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponsesInputTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens read from the prefix cache; ``cache_write_tokens``: the
    others, computed and written to the KV cache."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class ResponsesOutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponsesInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponsesOutputTokensDetails
    total_tokens: int


class ResponsesIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponsesObject(BaseModel):
    """The response object (``object: "response"``), as ``POST /v1/responses`` returns it and
    ``GET /v1/responses/{id}`` gives it back; the request's settings repeated."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: ResponsesIncompleteDetails | None = None
    model: str
    output: list[
        Annotated[ResponsesOutputMessage | ResponsesFunctionCall, Field(discriminator="type")]
    ]
    usage: ResponsesUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["auto", "disabled"]
    user: str | None = None
    metadata: dict[str, Any] | None = None
    background: bool = False


class ResponsesStreamEvent(BaseModel):
    """One event of a streamed response (``event: <type>`` and its ``data``): every event has
    its ``type`` and a ``sequence_number`` counting from 0; the rest depends on the type (OpenAI's
    ``response.created``, ``response.output_text.delta``... and ``error``)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


class ResponsesDeleted(BaseModel):
    """``DELETE /v1/responses/{id}``'s answer."""

    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


def event_json(data: dict[str, Any]) -> str:
    """An event's JSON, compact, as chunks are."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))
