"""Chat messages and tools, as requests give them and as the chat template takes them.

``messages`` (text content only; an assistant's earlier ``tool_calls``, a ``tool`` message's
``tool_call_id`` and a participant's ``name`` reach the template), ``tools`` (OpenAI's
function definitions) and ``tool_choice`` naming a function. :meth:`ChatMessage.as_template_dict`
and :func:`template_tools` give them in the form a chat template reads (vLLM's), for
/v1/chat/completions and /tokenize alike.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator
from pydantic_core import PydanticCustomError

from pagedkv.entrypoints.openai.protocol.fields import MAX_TOOLS, Text, valid_unicode
from pagedkv.entrypoints.openai.protocol.schema import StrictModel


class ContentPart(StrictModel):
    """A part of a message's content: only ``{"type": "text", "text": ...}`` is supported."""

    type: Literal["text"]
    text: Text


def _json_object_text(value: str) -> str:
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise ValueError(f"not JSON text: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError("not the JSON text of an object")
    return value


class FunctionCall(StrictModel):
    """A call's function: its name and its arguments as the JSON text of an object."""

    name: Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]
    arguments: Annotated[str, AfterValidator(valid_unicode), AfterValidator(_json_object_text)]


class MessageToolCall(StrictModel):
    """A tool call of an earlier assistant message (OpenAI's ``tool_calls[i]``)."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    """One message. An assistant's may hold ``tool_calls`` (its content then may be null); a
    ``tool`` message answers one of them (``tool_call_id``). Both, and ``name``, reach the chat
    template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    #: the participant's name (OpenAI's), passed to the template as vLLM does.
    name: Text | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise PydanticCustomError(
                        "content_type",
                        "only text content is supported (got a content part of type {kind})",
                        {"kind": repr(kind)},
                    )
        return value

    def as_template_dict(self) -> dict[str, Any]:
        """The ``{"role", "content"}`` dict a chat template expects (text parts joined), with
        ``name``, ``tool_calls`` (arguments as a dict, as templates read them, vLLM likewise) and
        ``tool_call_id`` when the message has them."""
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(part.text or "" for part in self.content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(StrictModel):
    """A function the model may call: ``parameters`` is a JSON Schema of its arguments
    (an object schema; none = no arguments)."""

    name: Annotated[str, Field(min_length=1, max_length=256), AfterValidator(valid_unicode)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    #: OpenAI's exact-schema flag; the schema is enforced (grammar) under tool_choice
    #: "required" or a named function whatever it says, never under "auto".
    strict: bool | None = None


class ChatTool(StrictModel):
    """One of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]


class NamedToolChoice(StrictModel):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """``tools`` as the chat template takes them (OpenAI's form); None when there are none."""
    if not tools:
        return None
    rendered = []
    for tool in tools:
        function = tool.function
        entry: dict[str, Any] = {"name": function.name}
        if function.description is not None:
            entry["description"] = function.description
        entry["parameters"] = function.parameters or {"type": "object", "properties": {}}
        rendered.append({"type": "function", "function": entry})
    return rendered


#: Keyword arguments of the template render that chat_template_kwargs may not set (the request's
#: own fields set them).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
