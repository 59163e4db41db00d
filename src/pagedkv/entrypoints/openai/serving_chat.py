"""``POST /v1/chat/completions``: the model's chat template applied to ``messages``
(``add_generation_prompt`` / ``continue_final_message``), ``n`` samples, logprobs with
``top_logprobs``, vLLM's ``prompt_logprobs``, streamed or not."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from pagedkv.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    chunk_json,
    now,
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
    sse,
    usage_of,
)
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import BeamSearchParams, SamplingParams


class _ChatResponse(StreamWriter):
    """The body (or the chunks) of one chat completion response."""

    def __init__(
        self, response_id: str, model: str, prompts: list[PromptState], options: Options
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.created = now()
        self.prompts = prompts
        self.options = options

    def logprobs_of(self, sample: Sample, start: int) -> ChatLogProbs | None:
        k = self.options.logprobs
        if k is None:
            return None
        return chat_logprobs(sample.token_ids[start:], sample.logprobs[start:], k)

    def body(self) -> ChatCompletionResponse:
        """The whole (non-streamed) response."""
        options = self.options
        choices = [
            ChatChoice(
                index=s.index,
                message=ChatResponseMessage(content=s.text),
                logprobs=self.logprobs_of(s, 0),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in choices_in_order(self.prompts)
        ]
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

    def _event(self, choices: list[ChatChunkChoice], usage: UsageInfo | None) -> str:
        body = ChatCompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )
        return sse(chunk_json(body))

    def _choice_event(self, choice: ChatChunkChoice) -> str:
        usage = usage_of(self.prompts, self.options) if self.options.continuous_usage else None
        return self._event([choice], usage)

    def first_chunks(self) -> list[str]:
        """Each choice's first delta: the assistant's role."""
        return [
            self._choice_event(
                ChatChunkChoice(index=s.index, delta=DeltaMessage(role="assistant", content=""))
            )
            for s in choices_in_order(self.prompts)
        ]

    def chunks(
        self, prompt: PromptState, sample: Sample, new_text: str, num_new: int, finish: str | None
    ) -> list[str]:
        events = []
        if new_text or num_new:
            logprobs = self.logprobs_of(sample, sample.num_tokens - num_new)
            delta = DeltaMessage(content=new_text)
            events.append(
                self._choice_event(
                    ChatChunkChoice(index=sample.index, delta=delta, logprobs=logprobs)
                )
            )
        if finish is not None:
            choice = ChatChunkChoice(
                index=sample.index,
                delta=DeltaMessage(),
                finish_reason=finish,
                stop_reason=sample.stop_reason,
            )
            events.append(self._choice_event(choice))
        return events

    def usage_chunk(self, usage: UsageInfo) -> str:
        return self._event([], usage)


class OpenAIServingChat(OpenAIServing):
    """``/v1/chat/completions`` over an engine client (see :class:`OpenAIServing`)."""

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
        if not self.engine_client.input_processor.has_chat_template:
            raise OpenAIError(
                400,
                f"this model (`{self.models.model_name}`) has no chat template (a base model); "
                "send a plain prompt to /v1/completions instead",
                param="messages",
                code="no_chat_template",
            )
        # No max_tokens: the reply may run to max_model_len (the engine's None).
        max_tokens = request.max_completion_tokens or request.max_tokens
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        options = Options(
            logprobs=top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
            continuous_usage=request.continuous_usage,
            include_usage=request.include_usage,
        )
        params: SamplingParams | BeamSearchParams = SamplingParams(
            **request.sampling_kwargs(),
            max_tokens=max_tokens,
            logprobs=top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
        )
        messages = request.template_messages()
        processed = await self.engine_client.process(
            lambda processor: processor.process_chat(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                add_special_tokens=request.add_special_tokens,
            )
        )
        if request.use_beam_search:  # without max_tokens: to max_model_len
            room = self.engine_client.input_processor.max_model_len - len(processed.token_ids)
            params = request.beam_search_params(max_tokens or max(room, 1))
        try:
            stream, prompts = await self.start(response_id, [processed], request, params)
        except InvalidRequestError as exc:
            if exc.param == "prompt":  # the engine's name for what a chat request calls messages
                exc.param = "messages"
            raise
        response = _ChatResponse(response_id, self.models.model_name, prompts, options)
        if request.stream:
            events = self.sse_stream(stream, prompts, options, response)
            return StreamingResponse(events, media_type="text/event-stream")
        await self.collect(stream, prompts, raw_request, options)
        raise_if_failed(prompts)
        return JSONResponse(response.body().model_dump())
