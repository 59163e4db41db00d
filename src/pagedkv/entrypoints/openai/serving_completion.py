"""``POST /v1/completions``: text or token-id prompts (one or a batch), ``n`` samples each (or
``n`` beams with vLLM's ``use_beam_search``), echo, logprobs, vLLM's ``prompt_logprobs``, streamed
or not."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.engine.input_processor import InputProcessor, ProcessedPrompt
from pagedkv.entrypoints.openai.logprobs import completion_logprobs, vllm_prompt_logprobs
from pagedkv.entrypoints.openai.protocol.requests import CompletionRequest
from pagedkv.entrypoints.openai.protocol.responses import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    random_id,
)
from pagedkv.entrypoints.openai.serving_engine import (
    OpenAIServing,
    Options,
    PromptState,
    Sample,
    StreamWriter,
    choices_in_order,
    prompt_of,
    raise_if_failed,
    usage_of,
)
from pagedkv.sampling_params import BeamSearchParams, SamplingParams


def _process_prompts(
    processor: InputProcessor, request: CompletionRequest, with_strs: bool
) -> list[tuple[ProcessedPrompt, list[str] | None]]:
    """Runs on the input thread: every prompt of the request tokenized and checked (text kept
    or decoded for echo), with each token's text when echo needs logprobs."""
    result = []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            processed = processor.process_text(
                prompt, add_special_tokens=request.add_special_tokens
            )
        else:
            processed = processor.process_token_ids(prompt, with_text=request.echo)
        strs = processor.decode_tokens(processed.token_ids) if with_strs else None
        result.append((processed, strs))
    return result


class _CompletionResponse(StreamWriter):
    """The body (or the chunks) of one completion response."""

    chunk_type = CompletionResponse

    def echo_part(self, prompt: PromptState) -> tuple[str, CompletionLogProbs | None, int]:
        """The prompt's text and logprobs when echoed (the first token's is None), and the text
        offset after it."""
        options = self.options
        if not options.echo:
            return "", None, 0
        text = prompt.text or ""
        if options.logprobs is None:
            return text, None, len(text)
        positions = list(prompt.prompt_logprobs or [None] * len(prompt.token_ids))
        logprobs, offset = completion_logprobs(
            prompt.token_ids, positions, options.logprobs, 0, prompt.token_strs
        )
        return text, logprobs, offset

    def generated_logprobs(
        self, sample: Sample, start: int, offset: int
    ) -> tuple[CompletionLogProbs, int]:
        return completion_logprobs(
            sample.token_ids[start:], sample.logprobs[start:], self.options.logprobs, offset
        )

    def body(self) -> CompletionResponse:
        """The whole (non-streamed) response."""
        options = self.options
        choices = []
        for sample in choices_in_order(self.prompts):
            prompt = prompt_of(self.prompts, sample)
            text, logprobs, offset = self.echo_part(prompt)
            if options.logprobs is not None:
                generated, _ = self.generated_logprobs(sample, 0, offset)
                if logprobs is None:
                    logprobs = generated
                else:
                    for name in CompletionLogProbs.model_fields:
                        getattr(logprobs, name).extend(getattr(generated, name))
            prompt_logprobs = None
            if options.prompt_logprobs is not None:
                prompt_logprobs = vllm_prompt_logprobs(
                    prompt.token_ids, prompt.prompt_logprobs, options.prompt_logprobs
                )
            choices.append(
                CompletionChoice(
                    index=sample.index,
                    text=text + sample.text,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_of(self.prompts, options),
        )

    def chunks(
        self, prompt: PromptState, sample: Sample, new_text: str, num_new: int, finish: str | None
    ) -> list[str]:
        options = self.options
        events = []
        if not prompt.started:  # the prompt's first output: its echo, for every sample
            prompt.started = True
            if options.echo:
                for each in prompt.samples:
                    text, logprobs, each.text_offset = self.echo_part(prompt)
                    events.append(
                        self.choice_event(
                            CompletionChoice(index=each.index, text=text, logprobs=logprobs)
                        )
                    )
        logprobs = None
        if options.logprobs is not None:
            start = sample.num_tokens - num_new
            logprobs, sample.text_offset = self.generated_logprobs(
                sample, start, sample.text_offset
            )
        choice = CompletionChoice(
            index=sample.index,
            text=new_text,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=sample.stop_reason if finish is not None else None,
        )
        events.append(self.choice_event(choice))
        return events


class OpenAIServingCompletion(OpenAIServing):
    """``/v1/completions`` over an engine client (see :class:`OpenAIServing`)."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Run one completion request; a JSON body, or server-sent events when ``stream``.

        Raises:
            OpenAIError, UnsupportedFieldError, InvalidRequestError: 4xx naming the field.
            EngineDeadError: the engine is not serving (503).
        """
        response_id = random_id("cmpl")
        self.check_request(request, response_id)
        # The client's value (OpenAI's default 16 when absent: the request model's); 0 with
        # echo generates one token, then dropped.
        max_tokens = request.max_tokens
        options = Options(
            echo=request.echo,
            echo_only=request.echo and max_tokens == 0,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            continuous_usage=request.continuous_usage,
            include_usage=request.include_usage,
        )
        # Echo with logprobs returns the prompt tokens' logprobs: the engine computes them.
        engine_prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            engine_prompt_logprobs = max(engine_prompt_logprobs or 0, request.logprobs)
        params: SamplingParams | BeamSearchParams
        if request.use_beam_search:
            params = request.beam_search_params(1 if max_tokens == 0 else max_tokens)
        else:
            params = SamplingParams(
                **request.sampling_kwargs(),
                max_tokens=1 if max_tokens == 0 else max_tokens,  # echo_only: 1, then dropped
                logprobs=request.logprobs,
                prompt_logprobs=engine_prompt_logprobs,
            )
        with_strs = request.echo and request.logprobs is not None
        processed = await self.engine_client.process(
            lambda processor: _process_prompts(processor, request, with_strs)
        )
        stream, prompts = await self.start(response_id, [p for p, _ in processed], request, params)
        for state, (_, strs) in zip(prompts, processed, strict=True):
            state.token_strs = strs
        response = _CompletionResponse(response_id, self.models.model_name, prompts, options)
        if request.stream:
            events = self.sse_stream(stream, prompts, options, response)
            return StreamingResponse(events, media_type="text/event-stream")
        await self.collect(stream, prompts, raw_request, options)
        raise_if_failed(prompts)
        return JSONResponse(response.body().model_dump())
