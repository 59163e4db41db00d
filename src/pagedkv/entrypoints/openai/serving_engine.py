"""What the completion and chat handlers share: the engine requests of one HTTP request, their
outputs as events, abort on disconnect, and server-sent events.

Each prompt is one engine request (id ``<response id>-<prompt index>``) with the request's ``n``
samples, which fork from one prefill of the prompt (sharing its blocks); choice index = prompt
index * n + sample index. With a ``seed``, the engine seeds sample i with ``seed + i``, so samples
differ and the response is still reproducible.

A request whose client goes away (mid-stream, or while waiting for a non-streamed answer) is
aborted in the engine, which frees its blocks. A request that fails inside an engine step
(finish_reason "error") gets a 500 with the engine's message (mid-stream: an error event, then
``data: [DONE]``); the engine goes on serving the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pagedkv.cluster.protocol import ReplicaError
from pagedkv.engine.engine_loop import EngineDeadError, OutputStream
from pagedkv.engine.input_processor import ProcessedPrompt
from pagedkv.engine.protocol import EngineClient, EngineRequest
from pagedkv.entrypoints.log_setup import summarize_for_log
from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.openai.metrics import ServerMetrics
from pagedkv.entrypoints.openai.protocol.responses import UsageInfo, chunk_json, make_usage, now
from pagedkv.entrypoints.openai.protocol.structured_outputs import rename_constraint_error
from pagedkv.entrypoints.openai.serving_models import OpenAIServingModels
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Sample:
    """What the server tracks of one sample (one choice of the response)."""

    index: int  # choice index
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    #: one ``{token id: Logprob}`` per token of token_ids (requests with logprobs)
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why the engine failed it (finish_reason "error")
    last_token_time: float = 0.0
    text_offset: int = 0  # completions logprobs: characters of the choice's text so far

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class PromptState:
    """One engine request: a processed prompt with its n samples."""

    request_id: str
    samples: list[Sample]
    prompt: ProcessedPrompt
    num_prompt_tokens: int = 0
    num_cached_tokens: int | None = None
    token_strs: list[str] | None = None  # each prompt token's text (echo with logprobs)
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    started: bool = False  # its first engine output was seen (streamed echo sent)
    embedding: Any = None  # a pooling request's vector (float32 numpy), once finished

    @property
    def text(self) -> str | None:
        return self.prompt.text

    @property
    def token_ids(self) -> list[int]:
        return self.prompt.token_ids

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass(slots=True)
class Options:
    """What one HTTP request asks of the response, beyond the sampling parameters."""

    echo: bool = False
    echo_only: bool = False  # max_tokens 0 with echo: the prompt alone, generated token dropped
    logprobs: int | None = None  # completions logprobs / chat top_logprobs (k)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field (k)
    continuous_usage: bool = False
    include_usage: bool = False  # streams end with a usage chunk


def usage_of(prompts: list[PromptState], options: Options | None = None) -> UsageInfo:
    """Usage of a response: each prompt counted once however many samples it had."""
    num_prompt = sum(p.num_prompt_tokens for p in prompts)
    num_completion = 0
    if options is None or not options.echo_only:
        num_completion = sum(s.num_tokens for p in prompts for s in p.samples)
    cached = [p.num_cached_tokens for p in prompts]
    num_cached = None if None in cached else sum(cached)
    return make_usage(num_prompt, num_completion, num_cached)


def choices_in_order(prompts: list[PromptState]) -> list[Sample]:
    return sorted((s for p in prompts for s in p.samples), key=lambda s: s.index)


def prompt_of(prompts: list[PromptState], sample: Sample) -> PromptState:
    return prompts[sample.index // len(prompts[0].samples)]


def engine_error(sample: Sample) -> OpenAIError:
    """The 500 of a request the engine failed inside a step."""
    return OpenAIError(
        500,
        f"the request failed in the engine: {sample.error or 'unknown error'}",
        code="engine_error",
    )


def raise_if_failed(prompts: list[PromptState]) -> None:
    for sample in choices_in_order(prompts):
        if sample.finish_reason == "error":
            raise engine_error(sample)


def sse(payload: str) -> str:
    """One server-sent event."""
    return f"data: {payload}\n\n"


#: Stands for a text field in an event rendered once as a template (:meth:`StreamWriter.
#: text_event`): control characters no model name or response id holds.
_TEXT_SLOT = "\x00pagedkv-text\x00"


class StreamWriter:
    """The chunks of one streamed response (a completion's or a chat's): a subclass says what
    the client gets first, for each sample's new text or finish, and names its ``chunk_type``
    (the response model each event's JSON is).

    Args:
        response_id: the response's id (``chatcmpl-...`` / ``cmpl-...``).
        model: the served model's name.
        prompts: the request's prompts and their samples.
        options: what the client asked to be sent.
    """

    #: the pydantic model of one streamed event (set by each subclass)
    chunk_type: type[Any]

    def __init__(
        self, response_id: str, model: str, prompts: list[PromptState], options: Options
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.created = now()
        self.prompts = prompts
        self.options = options
        #: choice index -> its plain text event cut around the text (see :meth:`text_event`)
        self._text_templates: dict[int, tuple[str, str] | None] = {}

    def text_event(self, index: int, text: str, make_choice: Any) -> str:
        """The event of choice ``index``'s new ``text`` alone (no logprobs, no finish, no
        usage), exactly as :meth:`choice_event` writes ``make_choice(index, text)``, without
        building and dumping the response model for every token: that event is rendered once
        per choice with a placeholder for the text, and each token's event is the JSON string
        of its text between the two halves (the streamed path's cost per token, docs/perf.md).
        """
        template = self._text_templates.get(index, False)
        if template is False:
            event = self.choice_event(make_choice(index, _TEXT_SLOT))
            parts = event.split(json.dumps(_TEXT_SLOT, ensure_ascii=False))
            template = (parts[0], parts[1]) if len(parts) == 2 else None
            self._text_templates[index] = template
        if template is None:  # the placeholder is not where only the text is: the slow way
            return self.choice_event(make_choice(index, text))
        return template[0] + json.dumps(text, ensure_ascii=False) + template[1]

    def event(self, choices: list[Any], usage: UsageInfo | None) -> str:
        """One server-sent event: a chunk of ``choices`` (and ``usage`` when given)."""
        body = self.chunk_type(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )
        return sse(chunk_json(body))

    def choice_event(self, choice: Any) -> str:
        """The event of one choice's delta, with the usage so far under ``continuous_usage``."""
        usage = usage_of(self.prompts, self.options) if self.options.continuous_usage else None
        return self.event([choice], usage)

    def first_chunks(self) -> list[str]:
        """Events sent before any engine output (the chat's role deltas)."""
        return []

    def ends_early(self, sample: Sample, new_text: str) -> bool:
        """Whether the sample's output is complete before the engine ends it (a chat's
        ``tool_choice`` "required" that repeats a call), told each new piece of its text."""
        return False

    def chunks(
        self, prompt: PromptState, sample: Sample, new_text: str, num_new: int, finish: str | None
    ) -> list[str]:
        """Events for a sample's new text / tokens, or its finish (``finish`` not None)."""
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> str:
        """The last event of a stream with ``include_usage``: no choices, the usage."""
        return self.event([], usage)

    def last_chunks(self) -> list[str]:
        """Events after every sample has finished: the usage chunk under ``include_usage``
        (the Responses API's writer sends its ``response.completed`` here)."""
        if self.options.include_usage:
            return [self.usage_chunk(usage_of(self.prompts, self.options))]
        return []

    def error_chunk(self, error: OpenAIError) -> str:
        """The event of an error that ends the stream: OpenAI's error body as ``data``."""
        return sse(json.dumps(error.body()))

    def done_chunk(self) -> str | None:
        """The stream's last event, ``data: [DONE]`` (None: none, as the Responses API)."""
        return sse("[DONE]")


class OpenAIServing:
    """The request handling that completions and chat share.

    Args:
        engine_client: the engine (one engine loop, or a cluster's front end).
        models: the served model's name and card.
        metrics: the server's Prometheus metrics (observed per output).
    """

    def __init__(
        self, engine_client: EngineClient, models: OpenAIServingModels, metrics: ServerMetrics
    ) -> None:
        self.engine_client = engine_client
        self.models = models
        self.metrics = metrics

    # ---- request -> engine requests -----------------------------------------------------------

    def check_request(self, request: Any, response_id: str) -> None:
        """The model name, the refused fields (400 naming the field), and one warning line
        naming the known fields accepted without effect (unknown fields were a 400 already)."""
        self.models.check_model(request.model)
        request.check_supported()
        ignored = request.ignored_fields()
        if ignored:
            logger.warning(
                "request %s: fields without effect in pagedkv, ignored: %s",
                response_id,
                summarize_for_log(ignored),
            )

    async def start(
        self,
        response_id: str,
        prompts: list[ProcessedPrompt],
        request: Any,
        params: SamplingParams | BeamSearchParams,
    ) -> tuple[OutputStream, list[PromptState]]:
        """Add one engine request (with n samples, or n beams) per prompt; returns their shared
        stream.

        Raises:
            InvalidRequestError: parameters or a prompt the engine refuses, a structured-output
                constraint xgrammar cannot compile (``param``: the request's field that gave
                it); nothing is left queued.
        """
        # No tokenizer involved: read-only checks, fine on the event loop.
        self.engine_client.input_processor.check_params(params, request.priority)
        constrained = isinstance(params, SamplingParams) and params.structured_outputs is not None
        if constrained:  # parsed on the input thread (a 400 here)
            try:
                await self.engine_client.process(
                    lambda processor: processor.check_structured_outputs(params)
                )
            except InvalidRequestError as exc:
                raise rename_constraint_error(exc, request) from None
        engine_requests, states = [], []
        for prompt_index, prompt in enumerate(prompts):
            request_id = f"{response_id}-{prompt_index}"
            samples = [Sample(prompt_index * request.n + i) for i in range(request.n)]
            states.append(
                PromptState(request_id, samples, prompt, num_prompt_tokens=len(prompt.token_ids))
            )
            engine_requests.append(
                EngineRequest(
                    request_id,
                    prompt,
                    params,
                    priority=request.priority,
                    cache_salt=request.cache_salt,
                    prompt_cache_key=request.prompt_cache_key,
                )
            )
        try:
            stream = await self.engine_client.add_requests(engine_requests)
        except InvalidRequestError as exc:
            if exc.param == "beam_width":  # the engine's name for a beam search's n
                exc.param = "n"
                raise
            raise rename_constraint_error(exc, request) from None
        return stream, states

    # ---- engine outputs -----------------------------------------------------------------------

    async def events(
        self,
        stream: OutputStream,
        prompts: list[PromptState],
        options: Options,
        writer: StreamWriter | None = None,
    ) -> AsyncIterator[tuple[PromptState, Sample, str, int]]:
        """Yields (prompt, sample, new text, number of new tokens) whenever a sample gets text,
        tokens or finishes; observes the metrics. Ends when every sample has finished. With
        ``echo_only`` the generated token is dropped (no text, no tokens). A sample the
        ``writer`` ends early (:meth:`StreamWriter.ends_early`) finishes with "stop"; the engine
        request is aborted once all its samples have (its blocks freed at once)."""
        metrics = self.metrics
        by_id = {p.request_id: p for p in prompts}
        num_finished = 0  # prompts whose samples have all finished (some maybe ended early)
        while not stream.finished and num_finished < len(prompts):
            output, step_time = await stream.get()
            prompt = by_id[output.request_id]
            if prompt.num_cached_tokens is None:
                prompt.num_prompt_tokens = len(output.prompt_token_ids)
                prompt.num_cached_tokens = output.num_cached_tokens
                metrics.prompt_tokens.inc(prompt.num_prompt_tokens)
            if prompt.prompt_logprobs is None and output.prompt_logprobs is not None:
                prompt.prompt_logprobs = output.prompt_logprobs
            if output.embedding is not None:  # a pooling request (/v1/embeddings)
                prompt.embedding = output.embedding
            for completion in output.outputs:
                sample = prompt.samples[completion.index]
                if sample.finish_reason is not None:
                    continue
                new_token_ids = list(completion.new_token_ids)
                new_text = completion.new_text
                if options.echo_only:
                    new_token_ids, new_text = [], ""
                if new_token_ids:
                    if sample.num_tokens == 0:
                        metrics.time_to_first_token.observe(step_time - stream.arrival_time)
                    else:
                        metrics.observe_inter_token_latency(step_time - sample.last_token_time)
                    sample.last_token_time = step_time
                    sample.token_ids += new_token_ids
                    metrics.generation_tokens.inc(len(new_token_ids))
                    if completion.logprobs is not None:
                        done = len(completion.logprobs) - len(new_token_ids)
                        sample.logprobs += completion.logprobs[done:]
                if new_text:
                    sample.text_parts.append(new_text)
                if completion.finish_reason is not None:
                    sample.finish_reason = completion.finish_reason
                    sample.stop_reason = completion.stop_reason
                    sample.error = completion.error
                    metrics.observe_finished(sample.finish_reason, step_time - stream.arrival_time)
                    num_finished += prompt.finished
                elif new_text and writer is not None and writer.ends_early(sample, new_text):
                    sample.finish_reason = "stop"
                    metrics.observe_finished("stop", step_time - stream.arrival_time)
                    if prompt.finished:  # the engine would not end it: abort it
                        num_finished += 1
                        self.engine_client.abort([prompt.request_id])
                if new_text or new_token_ids or sample.finish_reason is not None:
                    yield prompt, sample, new_text, len(new_token_ids)

    def finish_unfinished(self, prompts: list[PromptState], reason: str = "abort") -> None:
        """Abort the engine requests of samples still running, counted as ``reason``: "abort"
        (the client left) or "error" (the engine or a replica failed)."""
        unfinished = [p for p in prompts if not p.finished]
        if not unfinished:
            return
        self.engine_client.abort([p.request_id for p in unfinished])
        for prompt in unfinished:
            for sample in prompt.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = reason
                    self.metrics.observe_finished(reason, None)

    async def collect(
        self,
        stream: OutputStream,
        prompts: list[PromptState],
        raw_request: Request,
        options: Options,
        writer: StreamWriter | None = None,
    ) -> None:
        """Run a non-streamed request to its end; aborts it if the client disconnects first.
        ``writer``: the response, which may end a sample early (see :meth:`events`).

        Raises:
            EngineDeadError (or a replica's error): the engine failed; its requests were
                aborted and counted as errors.
        """

        async def drain() -> None:
            async for _ in self.events(stream, prompts, options, writer):
                pass

        async def disconnected() -> None:
            while (await raw_request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(drain())
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                self.finish_unfinished(prompts)
        if not work.cancelled() and work.exception() is not None:
            self.finish_unfinished(prompts, "error")
            raise work.exception()

    async def sse_stream(
        self,
        stream: OutputStream,
        prompts: list[PromptState],
        options: Options,
        writer: StreamWriter,
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed response (``writer``'s), ending with ``data:
        [DONE]`` (``writer.done_chunk``); the engine requests are aborted if the client goes
        away first. A sample the engine failed, or an engine that stopped, ends the stream with
        an error event (``writer.error_chunk``; the text so far was sent), then ``[DONE]``."""
        reason = "abort"
        try:
            for chunk in writer.first_chunks():
                yield chunk
            async for prompt, sample, new_text, num_new in self.events(
                stream, prompts, options, writer
            ):
                if sample.finish_reason == "error":
                    if new_text or num_new:
                        for chunk in writer.chunks(prompt, sample, new_text, num_new, None):
                            yield chunk
                    yield writer.error_chunk(engine_error(sample))
                    break
                for chunk in writer.chunks(prompt, sample, new_text, num_new, sample.finish_reason):
                    yield chunk
            else:
                for chunk in writer.last_chunks():
                    yield chunk
        except EngineDeadError as exc:  # the engine (or a replica) stopped mid-stream
            reason = "error"
            logger.warning("a streamed request ended early: %s", exc)
            yield writer.error_chunk(OpenAIError(503, str(exc)))
        except ReplicaError as exc:  # a replica failed it (the message is client-safe)
            reason = "error"
            yield writer.error_chunk(OpenAIError(500, str(exc), code="replica_error"))
        except Exception:
            reason = "error"
            logger.exception("a streamed request failed")
            yield writer.error_chunk(OpenAIError(500, "internal server error"))
        finally:
            self.finish_unfinished(prompts, reason)
        done = writer.done_chunk()
        if done is not None:
            yield done
