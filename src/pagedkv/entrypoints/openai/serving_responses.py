"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` and ``DELETE /v1/responses/{id}``.

A Responses request runs as the chat request it is (protocol/responses_api.py builds it): the
chat handler checks it, renders the conversation through the chat template and starts it on the
engine (:meth:`~.serving_chat.OpenAIServingChat.start_chat`); tool choice, structured outputs,
abort on disconnect and the metrics are chat's. What differs is the answer: OpenAI's response
object, whose ``output`` holds a ``message`` item (the text) and ``function_call`` items, or
its stream of typed events (``event: response.created`` ... ``response.completed``), each with a
``sequence_number``. A 400 of the chat request names the Responses field (``input``, ``text``,
``max_output_tokens``...: :func:`responses_error`).

Stored responses (``store``, default true) are kept in a :class:`ResponseStore`, an LRU of
``--responses-store-size`` entries (0: none kept), with the conversation they end, so that
``previous_response_id`` continues it; ``GET /v1/responses/{id}`` gives one back and ``DELETE``
drops it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.entrypoints.log_setup import summarize_for_log
from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.openai.protocol.messages import ChatMessage
from pagedkv.entrypoints.openai.protocol.refusals import UnsupportedFieldError
from pagedkv.entrypoints.openai.protocol.responses import DeltaToolCall
from pagedkv.entrypoints.openai.protocol.responses_api import (
    ResponsesDeleted,
    ResponsesRequest,
    event_json,
    item_id,
    output_messages,
    response_id,
)
from pagedkv.entrypoints.openai.serving_chat import ChatResponseWriter, OpenAIServingChat
from pagedkv.entrypoints.openai.serving_engine import (
    Options,
    PromptState,
    Sample,
    raise_if_failed,
    usage_of,
)
from pagedkv.entrypoints.openai.tool_calling import ChoiceStream, ToolChoice
from pagedkv.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)

#: How many responses ``pagedkv serve`` keeps by default (``--responses-store-size``).
DEFAULT_RESPONSES_STORE_SIZE = 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A kept response: its body (the response object as sent) and the conversation it ends
    (its input after the previous response's, then its output; without ``instructions``)."""

    body: dict[str, Any]
    conversation: tuple[ChatMessage, ...]


class ResponseStore:
    """The responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: at most
    ``max_size``, the least recently used dropped first (a read or a continuation uses one).
    Used from the server's event loop only.

    Args:
        max_size: how many responses are kept; 0 keeps none (``store`` is then ignored, and
            ``previous_response_id`` is a 400).

    Raises:
        ConfigError: a negative size.
    """

    def __init__(self, max_size: int = DEFAULT_RESPONSES_STORE_SIZE) -> None:
        if max_size < 0:
            raise ConfigError(f"--responses-store-size must be >= 0, got {max_size}")
        self.max_size = max_size
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_size > 0

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, key: str) -> StoredResponse | None:
        stored = self._responses.get(key)
        if stored is not None:
            self._responses.move_to_end(key)
        return stored

    def put(self, key: str, stored: StoredResponse) -> None:
        if not self.enabled:
            return
        self._responses[key] = stored
        self._responses.move_to_end(key)
        while len(self._responses) > self.max_size:
            self._responses.popitem(last=False)

    def delete(self, key: str) -> bool:
        return self._responses.pop(key, None) is not None


#: A chat request's field -> the Responses request's field it came from.
_FIELDS = {
    "messages": "input",
    "prompt": "input",
    "response_format": "text",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}
#: How a chat error's message names the Responses fields.
_WORDS = (
    ("`response_format.json_schema.schema`", "`text.format.schema`"),
    ("`response_format`", "`text.format`"),
    ("`messages`", "`input`"),
    ("`max_completion_tokens`", "`max_output_tokens`"),
    ("max_tokens", "max_output_tokens"),
    ("send a plain prompt to /v1/completions instead", "use /v1/completions"),
)


def responses_error(exc: Exception) -> Exception:
    """A 400 of the chat request told with the Responses request's fields (``param`` and the
    message); other exceptions unchanged."""
    if isinstance(exc, UnsupportedFieldError | InvalidRequestError | OpenAIError):
        param = exc.param
        message = exc.message if not isinstance(exc, InvalidRequestError) else str(exc)
        for chat, responses in _WORDS:
            message = message.replace(chat, responses)
        param = _FIELDS.get(param, param)
        if isinstance(exc, UnsupportedFieldError):
            return UnsupportedFieldError(param, message)
        if isinstance(exc, InvalidRequestError):
            return InvalidRequestError(message, param=param)
        return OpenAIError(exc.status_code, message, param=param, code=exc.code)
    return exc


def _sse(event: dict[str, Any]) -> str:
    """One server-sent event as OpenAI sends them: its type as ``event:``, then its data."""
    return f"event: {event['type']}\ndata: {event_json(event)}\n\n"


class _Output:
    """The output items of one response, built from the pieces of its text as they come (all at
    once when not streamed, so a streamed and a whole response are built alike): content pieces
    go to a ``message`` item, tool-call pieces to ``function_call`` items, in order. Each change
    is an event (kept only when streaming).

    Whitespace alone is held until text follows it, so that the blank between tool calls makes
    no message (as the whole-output parser drops it); a response with nothing else is a message
    of that text.
    """

    def __init__(self, writer: ResponsesWriter, streaming: bool) -> None:
        self.writer = writer
        self.streaming = streaming
        self.items: list[dict[str, Any]] = []
        self.events: list[str] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._parts: list[str] = []  # its text (a message's) or arguments (a call's)
        self._held = ""  # whitespace not yet in a message

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.streaming:
            self.events.append(self.writer.sse_event(kind, **fields))

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def text(self, piece: str) -> None:
        if self._open is None or self._open["type"] != "message":
            if not (self._held + piece).strip():
                self._held += piece
                return
            self._close("completed")
            self._open_message()
            piece, self._held = self._held + piece, ""
        if not piece:
            return
        self._parts.append(piece)
        self._emit(
            "response.output_text.delta",
            item_id=self._open["id"],
            output_index=self._index,
            content_index=0,
            delta=piece,
            logprobs=[],
        )

    def call(self, call_id: str, name: str) -> None:
        self._close("completed")
        self._open = {
            "id": item_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id,
            "name": name,
            "arguments": "",
        }
        self.items.append(self._open)
        self._emit("response.output_item.added", output_index=self._index, item=dict(self._open))

    def arguments(self, piece: str) -> None:
        if self._open is None or self._open["type"] != "function_call" or not piece:
            return
        self._parts.append(piece)
        self._emit(
            "response.function_call_arguments.delta",
            item_id=self._open["id"],
            output_index=self._index,
            delta=piece,
        )

    def finish(self, status: str) -> None:
        """Close the last item (``status``: "completed", or "incomplete" when cut by
        max_output_tokens); a response without any item gets a message (maybe empty)."""
        if not self.items:
            self._open_message()
            self.text_all(self._held)
        self._close(status)

    def text_all(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._emit(
                "response.output_text.delta",
                item_id=self._open["id"],
                output_index=self._index,
                content_index=0,
                delta=text,
                logprobs=[],
            )

    def _open_message(self) -> None:
        self._open = {
            "id": item_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.items.append(self._open)
        self._emit("response.output_item.added", output_index=self._index, item=dict(self._open))
        self._emit(
            "response.content_part.added",
            item_id=self._open["id"],
            output_index=self._index,
            content_index=0,
            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        )

    def _close(self, status: str) -> None:
        item = self._open
        if item is None:
            return
        done = "".join(self._parts)
        self._open, self._parts = None, []
        item["status"] = status
        if item["type"] == "message":
            part = {"type": "output_text", "text": done, "annotations": [], "logprobs": []}
            item["content"] = [part]
            self._emit(
                "response.output_text.done",
                item_id=item["id"],
                output_index=self._index,
                content_index=0,
                text=done,
                logprobs=[],
            )
            self._emit(
                "response.content_part.done",
                item_id=item["id"],
                output_index=self._index,
                content_index=0,
                part=part,
            )
        else:
            item["arguments"] = done
            self._emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=self._index,
                name=item["name"],
                arguments=done,
            )
        self._emit("response.output_item.done", output_index=self._index, item=item)

    def conversation(self) -> list[ChatMessage]:
        """The output as the assistant's message of the conversation."""
        texts = [
            item["content"][0]["text"]
            for item in self.items
            if item["type"] == "message" and item["content"]
        ]
        calls = [
            (item["call_id"], item["name"], item["arguments"])
            for item in self.items
            if item["type"] == "function_call"
        ]
        return output_messages("".join(texts) if texts else None, calls)


class ResponsesWriter(ChatResponseWriter):
    """The response object of one Responses request, or its stream of events. Built on the chat
    writer: the same tool-call reading (``ChoiceStream``) and the same early end of a
    ``"required"`` choice that repeats a call (``ends_early``).

    Args:
        response_id: ``resp_...``.
        model: the served model's name.
        prompts: the request's one prompt and its one sample.
        options: what the response asks for (no logprobs, no usage chunk).
        tool_choice: how the output is read.
        echo: the request's settings repeated in the response object.
        streaming: build the events (a streamed response).
    """

    def __init__(
        self,
        response_id: str,
        model: str,
        prompts: list[PromptState],
        options: Options,
        tool_choice: ToolChoice,
        echo: dict[str, Any],
        streaming: bool,
    ) -> None:
        super().__init__(response_id, model, prompts, options, tool_choice)
        self.echo = echo
        self.sequence_number = 0
        self.output = _Output(self, streaming)
        self.stream: ChoiceStream = tool_choice.streamer()
        #: the response object once the sample has finished (None before)
        self.final: dict[str, Any] | None = None

    def sse_event(self, kind: str, **fields: Any) -> str:
        """One event of the stream, numbered."""
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return _sse(event)

    def response_object(self, status: str, with_output: bool) -> dict[str, Any]:
        """The response object now: ``status``, the output items so far and the usage when
        ``with_output``."""
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": [],
            "usage": None,
            **self.echo,
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if with_output:
            body["output"] = [dict(item) for item in self.output.items]
            usage = usage_of(self.prompts, self.options)
            cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
            body["usage"] = {
                "input_tokens": usage.prompt_tokens,
                # cache_write_tokens: the prompt tokens computed, so written to the KV cache
                "input_tokens_details": {
                    "cached_tokens": cached,
                    "cache_write_tokens": usage.prompt_tokens - cached,
                },
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            }
        return body

    def feed(self, new_text: str, finish: str | None) -> dict[str, Any] | None:
        """The sample's new text (and its end): pieces to the output items. Returns the
        response object once ``finish`` is given (``final``), else None."""
        if self.tool_choice.kind == "none":
            pieces: list[str | DeltaToolCall] = [new_text] if new_text else []
        else:
            pieces = self.stream.feed(new_text, finish is not None)
        output = self.output
        for piece in pieces:
            if isinstance(piece, str):
                output.text(piece)
            elif piece.id is not None:
                output.call(piece.id, piece.function.name or "")
                output.arguments(piece.function.arguments or "")
            else:
                output.arguments(piece.function.arguments or "")
        if finish is not None:
            status = "incomplete" if finish == "length" else "completed"
            output.finish(status)
            self.final = self.response_object(status, with_output=True)
        return self.final

    def body_of(self, sample: Sample) -> dict[str, Any]:
        """The whole (non-streamed) response object of a finished sample."""
        return self.feed(sample.text, sample.finish_reason or "stop") or {}

    # ---- the stream (StreamWriter's hooks) ------------------------------------------------------

    def first_chunks(self) -> list[str]:
        body = self.response_object("in_progress", with_output=False)
        return [
            self.sse_event("response.created", response=body),
            self.sse_event("response.in_progress", response=body),
        ]

    def chunks(
        self, prompt: PromptState, sample: Sample, new_text: str, num_new: int, finish: str | None
    ) -> list[str]:
        self.feed(new_text, finish)
        events, self.output.events = self.output.events, []
        return events

    def last_chunks(self) -> list[str]:
        if self.final is None:
            return []
        kind = (
            "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        )
        return [self.sse_event(kind, response=self.final)]

    def error_chunk(self, error: OpenAIError) -> str:
        return self.sse_event("error", code=error.code, message=error.message, param=error.param)

    def done_chunk(self) -> str | None:
        return None


class OpenAIServingResponses:
    """``/v1/responses`` over the chat handler (the same engine path).

    Args:
        chat: the server's chat handler (its engine, template and tool-call options).
        store: the kept responses (default: an LRU of DEFAULT_RESPONSES_STORE_SIZE).
    """

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    def _check(self, request: ResponsesRequest, rid: str) -> None:
        """The model, the refused fields, and one warning line naming those without effect
        (``store`` among them when the server keeps no responses)."""
        self.chat.models.check_model(request.model)
        request.check_supported()
        ignored = request.ignored_fields()
        if "store" in request.model_fields_set and request.store and not self.store.enabled:
            ignored.append("store (the server keeps no responses: --responses-store-size 0)")
        if ignored:
            logger.warning(
                "request %s: fields without effect in pagedkv, ignored: %s",
                rid,
                summarize_for_log(ignored),
            )

    def _previous(self, request: ResponsesRequest) -> StoredResponse | None:
        key = request.previous_response_id
        if key is None:
            return None
        if not self.store.enabled:
            raise OpenAIError(
                400,
                "`previous_response_id`: this server keeps no responses "
                "(--responses-store-size 0); send the whole conversation in `input`",
                param="previous_response_id",
                code="store_disabled",
            )
        stored = self.store.get(key)
        if stored is None:
            raise OpenAIError(
                404,
                f"`previous_response_id`: no response with id {key!r} is stored (never made, "
                f"made with store false, deleted, or dropped: the server keeps the last "
                f"{self.store.max_size})",
                param="previous_response_id",
                code="response_not_found",
            )
        return stored

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        """Run one Responses request; the response object, or its events when ``stream``.

        Raises:
            OpenAIError: 404 for another model or an unknown ``previous_response_id``; 400 for
                ``previous_response_id`` on a server that keeps no responses, a model without
                a chat template.
            UnsupportedFieldError, InvalidRequestError: 400 naming the field.
            EngineDeadError: the engine is not serving (503).
        """
        rid = response_id()
        self._check(request, rid)
        previous = self._previous(request)
        conversation = [*(previous.conversation if previous else ()), *request.input_messages()]
        messages = list(conversation)
        if request.instructions is not None:
            messages.insert(0, ChatMessage(role="system", content=request.instructions))
        if not messages:
            raise UnsupportedFieldError(
                "input", "`input` is required (or `instructions`, or a `previous_response_id`)"
            )
        chat_request = request.chat_request(messages)
        try:
            chat_request.check_supported()
            stream, prompts, tool_choice, options = await self.chat.start_chat(chat_request, rid)
        except (UnsupportedFieldError, InvalidRequestError, OpenAIError) as exc:
            raise responses_error(exc) from None
        keep = request.store and self.store.enabled
        # "store" says whether this response is kept: false when the server keeps none
        echo = {**request.echo(), "store": keep}
        writer = ResponsesWriter(
            rid,
            self.chat.models.model_name,
            prompts,
            options,
            tool_choice,
            echo,
            streaming=request.stream,
        )

        def remember(body: dict[str, Any]) -> None:
            if keep:
                turn = (*conversation, *writer.output.conversation())
                self.store.put(rid, StoredResponse(body, turn))

        if request.stream:

            async def events() -> AsyncIterator[str]:
                async for event in self.chat.sse_stream(stream, prompts, options, writer):
                    yield event
                if writer.final is not None:
                    remember(writer.final)

            return StreamingResponse(events(), media_type="text/event-stream")
        await self.chat.collect(stream, prompts, raw_request, options, writer)
        raise_if_failed(prompts)
        body = writer.body_of(prompts[0].samples[0])
        remember(body)
        return JSONResponse(body)

    def retrieve(self, key: str) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: a kept response object.

        Raises:
            OpenAIError: 404 when it is not kept.
        """
        stored = self.store.get(key)
        if stored is None:
            raise self._not_found(key)
        return stored.body

    def delete(self, key: str) -> ResponsesDeleted:
        """``DELETE /v1/responses/{id}``: forget a kept response.

        Raises:
            OpenAIError: 404 when it is not kept.
        """
        if not self.store.delete(key):
            raise self._not_found(key)
        return ResponsesDeleted(id=key)

    def _not_found(self, key: str) -> OpenAIError:
        why = "" if self.store.enabled else " (the server keeps none: --responses-store-size 0)"
        return OpenAIError(
            404,
            f"no response with id {key!r} is stored{why}",
            param="response_id",
            code="response_not_found",
        )
