"""Tool calling of one chat request: which calls its ``tool_choice`` allows, the structured-output
constraint that enforces ``"required"`` and a named function (as vLLM does), and the calls read
back from each choice's text, whole or streamed.

- ``"none"``: the text is content (tools are still rendered through the template, as vLLM).
- ``"auto"``: the server's ``--tool-call-parser`` reads calls from the text; what it cannot read
  is content. ``finish_reason`` "stop" becomes "tool_calls" when there are calls.
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` whose
  items each match one tool (name const, parameters its schema); ``parallel_tool_calls: false``
  allows one item. The calls are read as the array grows (:class:`RequiredCallsReader`): each
  is sent once its item is complete, a call identical to an earlier one ends the choice (a
  greedy model repeats its call until max_tokens rather than close the array), and the calls
  complete before a max_tokens cut are kept. "stop" -> "tool_calls".
- a named function: the output is constrained to that function's parameters schema and is the
  call's arguments, streamed piece by piece; ``finish_reason`` stays "stop" (OpenAI's).

A function whose ``parameters`` name no property (none, ``{}``, ``{"type": "object"}``) takes
no arguments (OpenAI: "omitting parameters defines a function with an empty parameter list"):
its constrained arguments are ``{}``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedkv.entrypoints.openai.protocol.messages import NamedToolChoice
from pagedkv.entrypoints.openai.protocol.refusals import UnsupportedFieldError
from pagedkv.entrypoints.openai.protocol.requests import ChatCompletionRequest
from pagedkv.entrypoints.openai.protocol.responses import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from pagedkv.entrypoints.openai.tool_parsers import ToolCall, ToolCallStream, ToolParser
from pagedkv.entrypoints.openai.tool_parsers.base import read_call

#: The arguments of a function that takes none: the empty object (and nothing else).
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
#: Keys of an object schema that let it hold properties; without any, it names none.
_PROPERTY_KEYWORDS = ("properties", "additionalProperties", "patternProperties", "required", "$ref")
_SCHEMA_COMBINATORS = ("anyOf", "oneOf", "allOf", "if", "not", "enum", "const")


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema a tool's arguments are constrained to: ``parameters``, or
    :data:`NO_ARGUMENTS` when it names no property (None, ``{}``, ``{"type": "object"}``,
    ``{"type": "object", "properties": {}}``), which xgrammar would otherwise fill with free
    keys until max_tokens. The given dict is not changed."""
    if not parameters:
        return NO_ARGUMENTS
    if parameters.get("type", "object") != "object":
        return parameters
    if any(parameters.get(k) for k in _PROPERTY_KEYWORDS) or any(
        k in parameters for k in _SCHEMA_COMBINATORS
    ):
        return parameters
    return {**parameters, **NO_ARGUMENTS}


def tool_call_id() -> str:
    """A fresh tool-call id, ``call_<24 hex digits>`` (OpenAI's form)."""
    return f"call_{uuid.uuid4().hex[:24]}"


#: The keywords under which a schema keeps the subschemas its ``$ref``s point to
#: (``#/$defs/Name``; pydantic v1 and older drafts: ``#/definitions/Name``).
_DEFS_KEYWORDS = ("$defs", "definitions")


def required_schema(request: ChatCompletionRequest) -> dict[str, Any]:
    """The JSON Schema of ``tool_choice: "required"``: an array of at least one call, each
    ``{"name": <a tool's name>, "parameters": <its schema>}`` (at most one without
    parallel_tool_calls).

    A tool's ``$defs`` / ``definitions`` (pydantic writes nested models there, referenced as
    ``#/$defs/Name`` from the tool's root) move to the root of this schema, where those
    references now point, as vLLM does; the request is not changed.

    Raises:
        UnsupportedFieldError: two tools define the same ``$defs`` name differently (a 400
            naming ``tools``).
    """
    items = []
    defs: dict[str, dict[str, Any]] = {}  # keyword -> name -> subschema
    for tool in request.tools or ():
        parameters = dict(parameters_schema(tool.function.parameters))  # the request stays
        for keyword in _DEFS_KEYWORDS:
            found = parameters.get(keyword)
            if not isinstance(found, dict):
                continue  # absent, or malformed: left in place for xgrammar to refuse
            del parameters[keyword]
            merged = defs.setdefault(keyword, {})
            for name, subschema in found.items():
                if name in merged and merged[name] != subschema:
                    raise UnsupportedFieldError(
                        "tools",
                        f"`tool_choice` required: two tools define `{keyword}` `{name}` "
                        "differently; their schemas are joined in one, so give the "
                        "definitions distinct names",
                    )
                merged[name] = subschema
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def named_schema(request: ChatCompletionRequest, name: str) -> dict[str, Any]:
    """The JSON Schema of a named ``tool_choice``: that function's parameters."""
    for tool in request.tools or ():
        if tool.function.name == name:
            return parameters_schema(tool.function.parameters)
    raise KeyError(name)  # check_supported refused it before


_DECODER = json.JSONDecoder()
_SPACE = " \t\n\r"


@dataclass(slots=True)
class RequiredCallsReader:
    """The calls of a ``"required"`` output (a JSON array of ``{"name", "parameters"}``),
    read as its text grows, each once its item is complete.

    Reading stops (``ended``) when the array closes, at the first call identical to an earlier
    one (same name and arguments: the repeat is dropped and the choice ends there, since a
    greedy model that repeats a call repeats it until max_tokens: SmolLM2 wrote its one call
    7 times in 250 tokens) or at text that is not such an array (the grammar makes none; the
    calls before it are kept). An output cut by max_tokens keeps its complete calls.

    Attributes:
        calls: the calls read so far, in order, no two identical.
        closed: the array was closed (``]``).
        repeated: a call repeated an earlier one.
    """

    calls: list[ToolCall] = field(default_factory=list)
    closed: bool = False
    repeated: bool = False
    invalid: bool = False
    _unread: str = ""  # the text after the last item or separator read
    _expect: str = "["  # "[", "item" or "," (a separator, or "]" to end)
    _seen: set[tuple[str, str]] = field(default_factory=set)
    _waiting: bool = False  # the unread item did not parse yet: wait for a "}"

    @property
    def ended(self) -> bool:
        return self.closed or self.repeated or self.invalid

    def feed(self, text: str) -> list[ToolCall]:
        """Read ``text`` (the next piece of the output); returns the calls it completed."""
        new: list[ToolCall] = []
        if self.ended:
            return new
        self._unread += text
        if self._waiting and "}" not in text:  # an item (an object) can only end at a "}"
            return new
        self._waiting = False
        while not self.ended:
            unread = self._unread.lstrip(_SPACE)
            if not unread:
                break
            if self._expect != "item":
                if unread[0] == self._expect:
                    self._expect = "item"
                elif self._expect == "," and unread[0] == "]":
                    self.closed = True
                else:
                    self.invalid = True
                self._unread = unread[1:]
                continue
            try:
                item, end = _DECODER.raw_decode(unread)
            except ValueError:
                # Unfinished: what the grammar lets through is valid JSON so far.
                self._unread, self._waiting = unread, True
                break
            call = read_call(item, ("parameters", "arguments"))
            if call is None:
                self.invalid = True
                break
            key = (call.name, json.dumps(json.loads(call.arguments), sort_keys=True))
            if key in self._seen:
                self.repeated = True
                break
            self._seen.add(key)
            self.calls.append(call)
            new.append(call)
            self._unread, self._expect = unread[end:], ","
        return new


def parse_required(text: str) -> list[ToolCall] | None:
    """The calls of a whole ``"required"`` output (see :class:`RequiredCallsReader`); None if it
    holds no complete call (an output cut short by max_tokens before its first)."""
    reader = RequiredCallsReader()
    reader.feed(text)
    return reader.calls or None


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """How one request's choices are read.

    Attributes:
        kind: "none", "auto", "required" or "named".
        parser: the tool-call parser ("auto").
        function_name: the function of a named choice.
        parallel: more than one call per choice (``parallel_tool_calls``).
    """

    kind: str = "none"
    parser: ToolParser | None = None
    function_name: str | None = None
    parallel: bool = True

    @classmethod
    def of(cls, request: ChatCompletionRequest, parser: ToolParser | None) -> ToolChoice:
        choice = request.effective_tool_choice
        parallel = request.parallel_tool_calls
        if isinstance(choice, NamedToolChoice):
            return cls("named", function_name=choice.function.name, parallel=parallel)
        if choice == "auto" and request.tools:
            return cls("auto", parser=parser, parallel=parallel)
        if choice == "required":
            return cls("required", parallel=parallel)
        return cls("none")

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole choice's text -> (content, calls)."""
        if self.kind == "auto" and self.parser is not None:
            result = self.parser.extract(text)
            return result.content, self._limit(result.tool_calls)
        if self.kind == "required":
            calls = parse_required(text)
            return (text, []) if calls is None else (None, self._limit(calls))
        if self.kind == "named" and self.function_name is not None:
            return None, [ToolCall(self.function_name, text)]
        return text, []

    def _limit(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.parallel else calls[:1]

    def finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        """ "stop" -> "tool_calls" when an auto / required choice made calls."""
        if reason == "stop" and num_calls and self.kind in ("auto", "required"):
            return "tool_calls"
        return reason

    def streamer(self) -> ChoiceStream:
        return ChoiceStream(self)


def tool_calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [
        ToolCallOut(id=tool_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in calls
    ]


@dataclass(slots=True)
class ChoiceStream:
    """One streamed choice's text -> content pieces and ``tool_calls`` deltas."""

    mode: ToolChoice
    num_calls: int = 0
    _parser_stream: ToolCallStream | None = None
    _held: list[str] = field(default_factory=list)  # "required": its text (content if no call)
    _required: RequiredCallsReader = field(default_factory=RequiredCallsReader)

    def __post_init__(self) -> None:
        if self.mode.kind == "auto" and self.mode.parser is not None:
            self._parser_stream = self.mode.parser.streamer()

    def feed(self, text: str, finished: bool) -> list[str | DeltaToolCall]:
        """The deltas of new text (and of the end, when ``finished``): content strings and
        tool-call pieces, in order."""
        kind = self.mode.kind
        out: list[str | DeltaToolCall] = []
        if self._parser_stream is not None:
            events = self._parser_stream.feed(text) if text else []
            if finished:
                events += self._parser_stream.finish()
            for event in events:
                if isinstance(event, str):
                    out.append(event)
                else:
                    out += self._call(event)
        elif kind == "required":
            # Each call is sent once its item is complete; text without any call (cut by
            # max_tokens before the first) is content at the end.
            self._held.append(text)
            for call in self._required.feed(text):
                out += self._call(call)
            if finished and not self._required.calls:
                out.append("".join(self._held))
        elif kind == "named" and self.mode.function_name is not None:
            if self.num_calls == 0 and (text or finished):
                out += self._call(ToolCall(self.mode.function_name, ""))
            if text:
                out.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text)))
        elif text:
            out.append(text)
        return out

    def _call(self, call: ToolCall) -> list[str | DeltaToolCall]:
        """A call's deltas: its header (id, type, name, empty arguments), then its arguments."""
        if not self.mode.parallel and self.num_calls >= 1:
            return []
        index = self.num_calls
        self.num_calls += 1
        header = DeltaToolCall(
            index=index,
            id=tool_call_id(),
            type="function",
            function=DeltaFunctionCall(name=call.name, arguments=""),
        )
        if not call.arguments:
            return [header]
        return [
            header,
            DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments)),
        ]
