"""``POST /v1/chat/completions``: the chat template (the model's, ``--chat-template``'s or, when
trusted, the request's) applied to ``messages`` and ``tools`` (``add_generation_prompt`` /
``continue_final_message`` / ``chat_template_kwargs``), ``n`` samples, logprobs with
``top_logprobs``, vLLM's ``prompt_logprobs``, tool calls (tool_calling.py), streamed or not."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.engine.engine_loop import OutputStream
from pagedkv.entrypoints.openai.chat_options import ChatOptions
from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from pagedkv.entrypoints.openai.protocol.messages import template_tools
from pagedkv.entrypoints.openai.protocol.refusals import UnsupportedFieldError
from pagedkv.entrypoints.openai.protocol.requests import ChatCompletionRequest
from pagedkv.entrypoints.openai.protocol.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatResponseMessage,
    DeltaMessage,
    DeltaToolCall,
    random_id,
)
from pagedkv.entrypoints.openai.serving_engine import (
    OpenAIServing,
    Options,
    PromptState,
    Sample,
    StreamWriter,
    choices_in_order,
    raise_if_failed,
    usage_of,
)
from pagedkv.entrypoints.openai.tool_calling import (
    ChoiceStream,
    RequiredCallsReader,
    ToolChoice,
    named_schema,
    required_schema,
    tool_calls_out,
)
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)


class ChatResponseWriter(StreamWriter):
    """The body (or the chunks) of one chat completion response (the Responses API's writer
    builds on it: serving_responses.py)."""

    chunk_type = ChatCompletionChunk

    def __init__(
        self,
        response_id: str,
        model: str,
        prompts: list[PromptState],
        options: Options,
        tool_choice: ToolChoice,
    ) -> None:
        super().__init__(response_id, model, prompts, options)
        self.tool_choice = tool_choice
        #: choice index -> its stream of content and tool-call deltas
        self.streams: dict[int, ChoiceStream] = {}
        #: choice index -> the calls of its "required" output so far (to end it at a repeat)
        self.readers: dict[int, RequiredCallsReader] = {}

    def ends_early(self, sample: Sample, new_text: str) -> bool:
        """A "required" choice ends at its first call identical to an earlier one (see
        :class:`RequiredCallsReader`), or when its text cannot hold another call."""
        if self.tool_choice.kind != "required":
            return False
        reader = self.readers.get(sample.index)
        if reader is None:
            reader = self.readers[sample.index] = RequiredCallsReader()
        reader.feed(new_text)
        return reader.repeated

    def logprobs_of(self, sample: Sample, start: int) -> ChatLogProbs | None:
        k = self.options.logprobs
        if k is None:
            return None
        return chat_logprobs(sample.token_ids[start:], sample.logprobs[start:], k)

    def body(self) -> ChatCompletionResponse:
        """The whole (non-streamed) response."""
        options = self.options
        choices = []
        for s in choices_in_order(self.prompts):
            content, calls = self.tool_choice.split(s.text)
            message = ChatResponseMessage(
                content=content, tool_calls=tool_calls_out(calls) if calls else None
            )
            choices.append(
                ChatChoice(
                    index=s.index,
                    message=message,
                    logprobs=self.logprobs_of(s, 0),
                    finish_reason=self.tool_choice.finish_reason(s.finish_reason, len(calls)),
                    stop_reason=s.stop_reason,
                )
            )
        prompt_logprobs = None
        if options.prompt_logprobs is not None:
            prompt = self.prompts[0]
            prompt_logprobs = vllm_prompt_logprobs(
                prompt.token_ids, prompt.prompt_logprobs, options.prompt_logprobs
            )
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_of(self.prompts, options),
            prompt_logprobs=prompt_logprobs,
        )

    def first_chunks(self) -> list[str]:
        """Each choice's first delta: the assistant's role."""
        return [
            self.choice_event(
                ChatChunkChoice(index=s.index, delta=DeltaMessage(role="assistant", content=""))
            )
            for s in choices_in_order(self.prompts)
        ]

    def chunks(
        self, prompt: PromptState, sample: Sample, new_text: str, num_new: int, finish: str | None
    ) -> list[str]:
        events = []
        stream = self.streams.get(sample.index)
        if stream is None:
            stream = self.streams[sample.index] = self.tool_choice.streamer()
        if (
            new_text
            and finish is None
            and self.tool_choice.kind == "none"
            and self.options.logprobs is None
            and not self.options.continuous_usage
        ):  # the common token: its text alone
            return [self.text_event(sample.index, new_text, _content_choice)]
        if self.tool_choice.kind == "none":
            pieces: list[str | DeltaToolCall] = [new_text] if new_text or num_new else []
        else:
            pieces = stream.feed(new_text, finish is not None)
        logprobs = None
        if num_new:
            logprobs = self.logprobs_of(sample, sample.num_tokens - num_new)
            if logprobs is not None and not pieces:  # text held back: its logprobs go now
                pieces = [""]
        for piece in pieces:
            if isinstance(piece, str):
                delta = DeltaMessage(content=piece)
            else:
                delta = DeltaMessage(tool_calls=[piece])
            events.append(
                self.choice_event(
                    ChatChunkChoice(index=sample.index, delta=delta, logprobs=logprobs)
                )
            )
            logprobs = None  # on the first chunk of the step only
        if finish is not None:
            choice = ChatChunkChoice(
                index=sample.index,
                delta=DeltaMessage(),
                finish_reason=self.tool_choice.finish_reason(finish, stream.num_calls),
                stop_reason=sample.stop_reason,
            )
            events.append(self.choice_event(choice))
        return events


def _content_choice(index: int, text: str) -> ChatChunkChoice:
    return ChatChunkChoice(index=index, delta=DeltaMessage(content=text))


class OpenAIServingChat(OpenAIServing):
    """``/v1/chat/completions`` over an engine client (see :class:`OpenAIServing`).

    Args:
        chat_options: the server's template and tool-call options (default: the model's
            template, no auto tool choice).
        (the others: see :class:`OpenAIServing`)
    """

    def __init__(self, *args, chat_options: ChatOptions | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chat_options = chat_options or ChatOptions()
        self.tool_parser = self.chat_options.parser

    def tool_constraint(
        self, request: ChatCompletionRequest
    ) -> tuple[ToolChoice, StructuredOutputsParams | None]:
        """How the request's choices are read, and the output constraint its tool_choice
        needs (None for "none" / "auto").

        Raises:
            UnsupportedFieldError: "auto" on a server without --enable-auto-tool-choice;
                "required" / named together with the request's own constraint
                (``response_format`` json, ``structured_outputs``, ``guided_*``): a 400 naming
                ``tool_choice``.
        """
        mode = ToolChoice.of(request, self.tool_parser)
        if mode.kind == "auto" and self.tool_parser is None:
            raise UnsupportedFieldError(
                "tool_choice",
                '`tool_choice` "auto" (the default when `tools` are given) needs the server '
                "to run with --enable-auto-tool-choice and --tool-call-parser; send "
                '`tool_choice` "none" to only show the tools to the model',
            )
        if mode.kind not in ("required", "named"):
            return mode, None
        _, path = request.structured_output_params()
        if path is not None:
            raise UnsupportedFieldError(
                "tool_choice",
                f"`tool_choice` {mode.kind} constrains the output itself: it cannot be "
                f"combined with `{path.split('.', 1)[0]}`",
            )
        if mode.kind == "required":
            schema = required_schema(request)
        else:
            schema = named_schema(request, mode.function_name or "")
        # Compact JSON (one space after ":" and ","): free whitespace lets a small model write
        # newlines until max_tokens (SmolLM2 does, inside a no-argument call's "{}").
        return mode, StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        """Run one chat request; a JSON body, or server-sent events when ``stream``.

        Raises:
            OpenAIError: 400 for a model without a chat template; 404 for another model.
            UnsupportedFieldError, InvalidRequestError: 400 naming the field.
            EngineDeadError: the engine is not serving (503).
        """
        response_id = random_id("chatcmpl")
        self.check_request(request, response_id)
        stream, prompts, tool_choice, options = await self.start_chat(request, response_id)
        response = ChatResponseWriter(
            response_id, self.models.model_name, prompts, options, tool_choice
        )
        if request.stream:
            events = self.sse_stream(stream, prompts, options, response)
            return StreamingResponse(events, media_type="text/event-stream")
        await self.collect(stream, prompts, raw_request, options, response)
        raise_if_failed(prompts)
        return JSONResponse(response.body().model_dump())

    async def start_chat(
        self, request: ChatCompletionRequest, response_id: str
    ) -> tuple[OutputStream, list[PromptState], ToolChoice, Options]:
        """Render a checked chat request (``check_request`` done) through the chat template
        and add it to the engine; returns its output stream, its prompts, how its choices are
        read and what its response asks for. The Responses API (serving_responses.py) runs
        its requests through here too, as a chat request.

        Raises:
            OpenAIError: 400 for a model without a chat template.
            UnsupportedFieldError, InvalidRequestError: 400 naming the field.
            EngineDeadError: the engine is not serving (503).
        """
        if request.chat_template is not None and not self.chat_options.trust_request_chat_template:
            raise UnsupportedFieldError(
                "chat_template",
                "`chat_template` of a request is refused unless the server runs with "
                "--trust-request-chat-template (a template is code the server runs)",
            )
        chat_template = request.chat_template or self.chat_options.chat_template
        tool_choice, constraint = self.tool_constraint(request)
        if constraint is not None and request.use_beam_search:
            raise UnsupportedFieldError(
                "use_beam_search",
                "`use_beam_search` does not go with a constrained output (`tool_choice` "
                f"{request.tool_choice!r}): beams rank the model's raw log-probabilities",
            )
        if chat_template is None and not self.engine_client.input_processor.has_chat_template:
            raise OpenAIError(
                400,
                f"this model (`{self.models.model_name}`) has no chat template (a base model); "
                "send a plain prompt to /v1/completions instead",
                param="messages",
                code="no_chat_template",
            )
        # No max_tokens: the reply may run to max_model_len (the engine's None).
        max_tokens = request.max_completion_tokens or request.max_tokens
        top_logprobs = request.top_logprobs_asked()
        options = Options(
            logprobs=top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
            continuous_usage=request.continuous_usage,
            include_usage=request.include_usage,
        )
        sampling = request.sampling_kwargs()
        if constraint is not None:
            sampling["structured_outputs"] = constraint
        params: SamplingParams | BeamSearchParams = SamplingParams(
            **sampling,
            max_tokens=max_tokens,
            logprobs=top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
        )
        messages = request.template_messages()
        tools = template_tools(request.tools)
        processed = await self.engine_client.process(
            lambda processor: processor.process_chat(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                add_special_tokens=request.add_special_tokens,
                tools=tools,
                chat_template=chat_template,
                template_kwargs=request.chat_template_kwargs,
            )
        )
        if request.use_beam_search:  # None (absent): the engine resolves it, as for sampling
            params = request.beam_search_params(max_tokens)
        try:
            stream, prompts = await self.start(response_id, [processed], request, params)
        except InvalidRequestError as exc:
            if exc.param == "prompt":  # the engine's name for what a chat request calls messages
                exc.param = "messages"
            elif exc.param == "structured_outputs" and constraint is not None:
                # The schema tool_choice built from the tools' parameters: their fault.
                raise InvalidRequestError(
                    str(exc).replace(
                        "structured_outputs.json",
                        f"the schema `tool_choice` {tool_choice.kind} builds from `tools`",
                    ),
                    param="tools",
                ) from None
            raise
        return stream, prompts, tool_choice, options
