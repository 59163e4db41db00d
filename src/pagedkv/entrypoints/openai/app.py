"""The FastAPI app of `pagedkv serve`: OpenAI-compatible routes, streaming, abort on disconnect.

Routes::

    GET  /v1/models              the one served model
    GET  /v1/models/{id}         its card (404 for another name)
    POST /v1/completions         text completion (stream: server-sent events)
    POST /v1/chat/completions    chat completion, the model's chat template applied (400 for
                                 a base model without one: use /v1/completions)
    POST /tokenize               text or chat messages -> token ids (vLLM's)
    POST /detokenize             token ids -> text (vLLM's)
    GET  /tokenizer_info         special tokens and chat template (vLLM's; lm-eval reads it)
    GET  /version                {"version": pagedkv's}
    GET  /health, /ping          200 while the engine thread runs, else 503 with the reason
    GET  /metrics                Prometheus text format (see metrics.py)
    POST /reset_prefix_cache     {"success": bool}; fails while blocks are in use (an admin
                                 route: only with --enable-admin-routes, else 404)

Security and limits (API key, Origin / Host checks, body size and time, admin routes) are
server_options.py's: create_app installs them with one call.

Every request field is honoured or refused with a 400 naming it (protocol.py; the table is in
docs/server.md); fields without effect and unknown fields are named in one warning line.

Each prompt is one engine request (id ``<response id>-<prompt index>``) with the request's ``n``
samples, which share the prompt's cached blocks; choice index = prompt index * n + sample index.
With a ``seed``, the engine seeds sample i with ``seed + i``, so samples differ and the response
is still reproducible. Prompts are built in the engine thread (the tokenizer is not shared
between threads): text is tokenized, chat messages go through the model's chat template
(``add_generation_prompt`` / ``continue_final_message``), and the engine gets token ids.

A request whose client goes away (mid-stream, or while waiting for a non-streamed answer) is
aborted in the engine, which frees its blocks. Bad input gets the OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status, ``param`` naming the field.

A request that fails inside an engine step (finish_reason "error") gets a 500 with the engine's
message (mid-stream: an error event, then ``data: [DONE]``); the engine goes on serving the
others. Only an engine fault (see engine_loop.py) stops it: then every route answers 503 and
/health says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv import __version__
from pagedkv.engine.engine_loop import (
    EngineDeadError,
    EngineLoop,
    EngineRequest,
    OutputStream,
)
from pagedkv.entrypoints.log_setup import summarize_for_log
from pagedkv.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UnsupportedFieldError,
    UsageInfo,
    chunk_json,
    make_usage,
    now,
    random_id,
)
from pagedkv.entrypoints.openai.server_options import ServerOptions, install_middleware
from pagedkv.entrypoints.openai.stats_logger import StatsLogger
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error to send to the client as an OpenAI error body with ``status_code``."""

    def __init__(
        self, status_code: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        # Messages may quote the client's input: escape what UTF-8 cannot encode (surrogates).
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        error_type = _ERROR_TYPES.get(self.status_code, "invalid_request_error")
        info = ErrorInfo(message=self.message, type=error_type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


@dataclass(slots=True)
class _Sample:
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
class _Prompt:
    """One engine request: a prompt with its n samples. ``text``, ``token_ids`` and
    ``token_strs`` are filled in the engine thread when the prompt is built (:func:`_build`)."""

    request_id: str
    samples: list[_Sample]
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    text: str | None = None
    token_ids: list[int] = field(default_factory=list)
    token_strs: list[str] | None = None  # each prompt token's text (echo with logprobs)
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    started: bool = False  # its first engine output was seen (streamed echo sent)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass(slots=True)
class _Options:
    """What one HTTP request asks of the response, beyond the sampling parameters."""

    echo: bool = False
    echo_only: bool = False  # max_tokens 0 with echo: the prompt alone, generated token dropped
    logprobs: int | None = None  # completions logprobs / chat top_logprobs (k)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field (k)
    continuous_usage: bool = False


def _usage(prompts: list[_Prompt], options: _Options | None = None) -> UsageInfo:
    """Usage of a response: each prompt counted once however many samples it had."""
    num_prompt = sum(p.num_prompt_tokens or 0 for p in prompts)
    num_completion = 0
    if options is None or not options.echo_only:
        num_completion = sum(s.num_tokens for p in prompts for s in p.samples)
    cached = [p.num_cached_tokens for p in prompts]
    num_cached = None if None in cached else sum(cached)
    return make_usage(num_prompt, num_completion, num_cached)


def _choices_in_order(prompts: list[_Prompt]) -> list[_Sample]:
    return sorted((s for p in prompts for s in p.samples), key=lambda s: s.index)


def _prompt_of(prompts: list[_Prompt], sample: _Sample) -> _Prompt:
    n = len(prompts[0].samples)
    return prompts[sample.index // n]


def _engine_error(sample: _Sample) -> OpenAIError:
    """The 500 of a request the engine failed inside a step."""
    return OpenAIError(
        500,
        f"the request failed in the engine: {sample.error or 'unknown error'}",
        code="engine_error",
    )


def _raise_if_failed(prompts: list[_Prompt]) -> None:
    for sample in _choices_in_order(prompts):
        if sample.finish_reason == "error":
            raise _engine_error(sample)


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


# ---- logprobs in the OpenAI shapes ------------------------------------------------------------

#: JSON has no -inf: OpenAI (and vLLM) send this instead.
_MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _top(position: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    """The k most likely entries of a position (ranks 1..k), most likely first."""
    top = [(t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k]
    return sorted(top, key=lambda item: item[1].rank)[:k]


def _completion_logprobs(
    token_ids: list[int],
    positions: list[dict[int, Any] | None],
    k: int,
    offset: int,
    token_strs: list[str] | None = None,
) -> tuple[CompletionLogProbs, int]:
    """OpenAI's completions ``logprobs`` of consecutive tokens (a position None: the first
    prompt token, which has no logprob); returns it and the text offset after the last token."""
    out = CompletionLogProbs()
    for i, (token_id, position) in enumerate(zip(token_ids, positions, strict=True)):
        if position is None:
            text = token_strs[i] if token_strs is not None else ""
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            chosen = position[token_id]
            text = chosen.decoded_token or ""
            out.tokens.append(text)
            out.token_logprobs.append(_clamp(chosen.logprob))
            top = {text: _clamp(chosen.logprob)}
            for top_id, lp in _top(position, k):
                top[lp.decoded_token or str(top_id)] = _clamp(lp.logprob)
            out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def _chat_logprobs(token_ids: list[int], positions: list[dict[int, Any]], k: int) -> ChatLogProbs:
    """OpenAI's chat ``logprobs`` of generated tokens, ``top_logprobs`` = the k most likely."""

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = position[token_id]
        content.append(
            ChatTokenLogprob(
                **entry(chosen.decoded_token or "", chosen.logprob),
                top_logprobs=[
                    TopLogprob(**entry(lp.decoded_token or "", lp.logprob))
                    for _, lp in _top(position, k)
                ],
            )
        )
    return ChatLogProbs(content=content)


def _vllm_prompt_logprobs(prompt: _Prompt, k: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token ``{token id: {logprob, rank,
    decoded_token}}`` (the prompt token and the top k), the first None."""
    result: list[dict[str, PromptLogprob] | None] = []
    for token_id, position in zip(prompt.token_ids, prompt.prompt_logprobs or (), strict=False):
        if position is None:
            result.append(None)
            continue
        entries = {token_id: position[token_id], **dict(_top(position, k))}
        result.append(
            {
                str(t): PromptLogprob(
                    logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
                )
                for t, lp in entries.items()
            }
        )
    return result


# ---- prompts, built in the engine thread ------------------------------------------------------


def _text_prompt(state: _Prompt, text: str, add_special_tokens: bool, strs: bool):
    """A prompt builder for text: tokenized in the engine thread (the tokenizer is the engine's,
    and is not shared between threads)."""

    def build(engine: Any) -> dict[str, Any]:
        tokenizer = engine.tokenizer
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return _built(state, engine, text, ids, strs)

    return build


def _token_prompt(state: _Prompt, ids: list[int], echo: bool, strs: bool):
    """A prompt builder for token ids (decoded only when echoed)."""

    def build(engine: Any) -> dict[str, Any]:
        text = engine.tokenizer.decode(ids, skip_special_tokens=False) if echo else None
        return _built(state, engine, text, ids, strs)

    return build


def _chat_prompt(state: _Prompt, request: ChatCompletionRequest):
    """A prompt builder for chat messages: the model's chat template, then the tokenizer."""
    messages = request.template_messages()

    def build(engine: Any) -> dict[str, Any]:
        tokenizer = engine.tokenizer
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tokenize=False,
        )
        ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        return _built(state, engine, text, ids, False)

    return build


def _built(state: _Prompt, engine: Any, text: str | None, ids: list[int], strs: bool) -> dict:
    state.text = text
    state.token_ids = list(ids)
    if strs:
        state.token_strs = engine.tokenizer.decode_tokens(ids)
    prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
    if text is not None:
        prompt["prompt"] = text
    return prompt


class OpenAIServing:
    """The request handling behind the routes; owns the engine loop and the metrics.

    Args:
        engine: the engine (see :class:`EngineLoop` for what it must offer; ``tokenizer`` and,
            optionally, ``config.policy``).
        model_name: the name clients use in ``model``; other names get 404.
        max_model_len: shown by /v1/models.
        engine_loop: what drives the engine; default ``EngineLoop(engine)``. A cluster passes
            its own (:class:`pagedkv.entrypoints.cluster.frontend.ClusterEngineLoop`).
    """

    def __init__(
        self,
        engine: Any,
        *,
        model_name: str,
        max_model_len: int | None,
        engine_loop: Any = None,
    ) -> None:
        self.engine_loop = engine_loop if engine_loop is not None else EngineLoop(engine)
        tokenizer = getattr(engine, "tokenizer", None)
        #: False for a base model (Gemma 3 270M): chat requests are refused up front.
        self.has_chat_template = bool(getattr(tokenizer, "has_chat_template", True))
        self.metrics = ServerMetrics(model_name)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.policy = getattr(getattr(engine, "config", None), "policy", "fcfs")

    # ---- request -> engine requests -----------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def _check_request(self, request: Any, response_id: str) -> None:
        """The model name, the refused fields (400 naming the field), and the one warning line
        naming the fields accepted without effect."""
        self._check_model(request.model)
        request.check_supported()
        priority = getattr(request, "priority", 0)
        if priority and self.policy != "priority":
            raise UnsupportedFieldError(
                "priority",
                "`priority` needs the server to schedule by priority (--policy priority)",
            )
        ignored = request.ignored_fields()
        if ignored:
            logger.warning(
                "request %s: fields without effect in pagedkv, ignored: %s",
                response_id,
                summarize_for_log(ignored),  # bounded: a client may send 1,000 long names
            )

    async def _start(
        self,
        response_id: str,
        builders: list[Callable[[_Prompt], Callable[[Any], Any]]],
        request: Any,
        params: SamplingParams,
    ) -> tuple[OutputStream, list[_Prompt]]:
        """Add one engine request (with n samples) per prompt; returns their shared stream.

        Raises:
            InvalidRequestError: invalid sampling parameters, or a prompt the engine can never
                serve (longer than max_model_len with max_tokens); nothing is left queued.
        """
        engine_requests, states = [], []
        for prompt_index, builder in enumerate(builders):
            request_id = f"{response_id}-{prompt_index}"
            kwargs = {"cache_salt": request.cache_salt}
            if request.priority:
                kwargs["priority"] = request.priority
            samples = [_Sample(prompt_index * request.n + i) for i in range(request.n)]
            state = _Prompt(request_id, samples)
            engine_requests.append(EngineRequest(request_id, builder(state), params, kwargs))
            states.append(state)
        stream = await self.engine_loop.add_requests(engine_requests)
        for state in states:
            state.num_prompt_tokens = len(state.token_ids)
        return stream, states

    # ---- engine outputs -----------------------------------------------------------------------

    async def _events(
        self, stream: OutputStream, prompts: list[_Prompt], options: _Options
    ) -> AsyncIterator[tuple[_Prompt, _Sample, str, int]]:
        """Yields (prompt, sample, new text, number of new tokens) whenever a sample gets text,
        tokens or finishes; observes the metrics. Ends when every sample has finished. With
        ``echo_only`` the generated token is dropped (no text, no tokens)."""
        metrics = self.metrics
        by_id = {p.request_id: p for p in prompts}
        while not stream.finished:
            output, step_time = await stream.get()
            prompt = by_id[output.request_id]
            if prompt.num_cached_tokens is None:
                prompt.num_prompt_tokens = len(output.prompt_token_ids)
                prompt.num_cached_tokens = output.num_cached_tokens
                metrics.prompt_tokens.inc(prompt.num_prompt_tokens)
            if prompt.prompt_logprobs is None and output.prompt_logprobs is not None:
                prompt.prompt_logprobs = output.prompt_logprobs
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
                        metrics.inter_token_latency.observe(step_time - sample.last_token_time)
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
                    sample.error = getattr(completion, "error", None)
                    metrics.observe_finished(sample.finish_reason, step_time - stream.arrival_time)
                if new_text or new_token_ids or sample.finish_reason is not None:
                    yield prompt, sample, new_text, len(new_token_ids)

    def _abort_unfinished(self, prompts: list[_Prompt]) -> None:
        unfinished = [p for p in prompts if not p.finished]
        if not unfinished:
            return
        self.engine_loop.abort([p.request_id for p in unfinished])
        for prompt in unfinished:
            for sample in prompt.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "abort"
                    self.metrics.observe_finished("abort", None)

    async def _collect(
        self,
        stream: OutputStream,
        prompts: list[_Prompt],
        raw_request: Request,
        options: _Options,
    ) -> None:
        """Run a non-streamed request to its end; aborts it if the client disconnects first."""

        async def drain() -> None:
            async for _ in self._events(stream, prompts, options):
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
                self._abort_unfinished(prompts)
        if not work.cancelled():
            work.result()  # re-raise an engine failure

    async def _sse_stream(
        self,
        stream: OutputStream,
        prompts: list[_Prompt],
        options: _Options,
        first_chunks: list[str],
        chunks_of: Callable[[_Prompt, _Sample, str, int, str | None], list[str]],
        usage_chunk: Callable[[UsageInfo], str] | None,
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed response, ending with ``data: [DONE]``; the
        engine requests are aborted if the client goes away first. A sample the engine failed
        ends the stream with an error event (its text so far was sent)."""
        try:
            for chunk in first_chunks:
                yield chunk
            async for prompt, sample, new_text, num_new in self._events(stream, prompts, options):
                if sample.finish_reason == "error":
                    if new_text or num_new:
                        for chunk in chunks_of(prompt, sample, new_text, num_new, None):
                            yield chunk
                    yield _sse(json.dumps(_engine_error(sample).body()))
                    break
                for chunk in chunks_of(prompt, sample, new_text, num_new, sample.finish_reason):
                    yield chunk
            else:
                if usage_chunk is not None:
                    yield usage_chunk(_usage(prompts, options))
        except Exception as exc:  # the engine stopped mid-stream: tell the client
            if isinstance(exc, EngineDeadError):  # engine fault (logged there) or shutdown
                logger.info("streamed request ended: %s", exc)
            else:
                logger.exception("streamed request failed")
            status = 503 if isinstance(exc, EngineDeadError) else 500
            yield _sse(json.dumps(OpenAIError(status, str(exc)).body()))
        finally:
            self._abort_unfinished(prompts)
        yield _sse("[DONE]")

    # ---- routes ---------------------------------------------------------------------------------

    async def completions(self, request: CompletionRequest, raw_request: Request) -> Response:
        response_id = random_id("cmpl")
        self._check_request(request, response_id)
        max_tokens = request.max_tokens if request.max_tokens is not None else 16
        options = _Options(
            echo=request.echo,
            echo_only=request.echo and max_tokens == 0,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            continuous_usage=request.continuous_usage,
        )
        # Echo with logprobs returns the prompt tokens' logprobs: the engine computes them.
        engine_prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            engine_prompt_logprobs = max(engine_prompt_logprobs or 0, request.logprobs)
        params = SamplingParams(
            **request.sampling_kwargs(),
            max_tokens=max(max_tokens, 1),  # echo_only: one token is generated, then dropped
            logprobs=request.logprobs,
            prompt_logprobs=engine_prompt_logprobs,
        )
        strs = request.echo and request.logprobs is not None
        builders = []
        for prompt in request.prompts():
            if isinstance(prompt, str):
                builders.append(
                    lambda s, p=prompt: _text_prompt(s, p, request.add_special_tokens, strs)
                )
            else:
                builders.append(lambda s, p=prompt: _token_prompt(s, p, request.echo, strs))
        stream, prompts = await self._start(response_id, builders, request, params)
        created, model = now(), self.model_name

        def echo_part(prompt: _Prompt) -> tuple[str, CompletionLogProbs | None, int]:
            """The prompt's text and logprobs when echoed (the first token's is None)."""
            if not options.echo:
                return "", None, 0
            if options.logprobs is None:
                return prompt.text or "", None, len(prompt.text or "")
            positions = list(prompt.prompt_logprobs or [None] * len(prompt.token_ids))
            logprobs, offset = _completion_logprobs(
                prompt.token_ids, positions, options.logprobs, 0, prompt.token_strs
            )
            return prompt.text or "", logprobs, offset

        def generated_logprobs(sample: _Sample, start: int, offset: int):
            logprobs, offset = _completion_logprobs(
                sample.token_ids[start:], sample.logprobs[start:], options.logprobs, offset
            )
            return logprobs, offset

        if not request.stream:
            await self._collect(stream, prompts, raw_request, options)
            _raise_if_failed(prompts)
            choices = []
            for sample in _choices_in_order(prompts):
                prompt = _prompt_of(prompts, sample)
                text, logprobs, offset = echo_part(prompt)
                if options.logprobs is not None:
                    generated, _ = generated_logprobs(sample, 0, offset)
                    if logprobs is None:
                        logprobs = generated
                    else:
                        for name in CompletionLogProbs.model_fields:
                            getattr(logprobs, name).extend(getattr(generated, name))
                choices.append(
                    CompletionChoice(
                        index=sample.index,
                        text=text + sample.text,
                        logprobs=logprobs,
                        finish_reason=sample.finish_reason,
                        stop_reason=sample.stop_reason,
                        prompt_logprobs=(
                            None
                            if options.prompt_logprobs is None
                            else _vllm_prompt_logprobs(prompt, options.prompt_logprobs)
                        ),
                    )
                )
            response = CompletionResponse(
                id=response_id,
                created=created,
                model=model,
                choices=choices,
                usage=_usage(prompts, options),
            )
            return JSONResponse(response.model_dump())

        def body(choice: CompletionChoice) -> str:
            usage = _usage(prompts, options) if options.continuous_usage else None
            return _sse(
                chunk_json(
                    CompletionResponse(
                        id=response_id, created=created, model=model, choices=[choice], usage=usage
                    )
                )
            )

        def chunks_of(
            prompt: _Prompt, sample: _Sample, new_text: str, num_new: int, finish: str | None
        ) -> list[str]:
            chunks = []
            if not prompt.started:  # the prompt's first output: its echo, for every sample
                prompt.started = True
                if options.echo:
                    for each in prompt.samples:
                        text, logprobs, each.text_offset = echo_part(prompt)
                        chunks.append(
                            body(CompletionChoice(index=each.index, text=text, logprobs=logprobs))
                        )
            logprobs = None
            if options.logprobs is not None:
                start = sample.num_tokens - num_new
                logprobs, sample.text_offset = generated_logprobs(sample, start, sample.text_offset)
            stop_reason = sample.stop_reason if finish is not None else None
            choice = CompletionChoice(
                index=sample.index,
                text=new_text,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=stop_reason,
            )
            chunks.append(body(choice))
            return chunks

        def usage_chunk(usage: UsageInfo) -> str:
            done = CompletionResponse(
                id=response_id, created=created, model=model, choices=[], usage=usage
            )
            return _sse(chunk_json(done))

        events = self._sse_stream(
            stream,
            prompts,
            options,
            [],
            chunks_of,
            usage_chunk if request.include_usage else None,
        )
        return StreamingResponse(events, media_type="text/event-stream")

    async def chat_completions(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        response_id = random_id("chatcmpl")
        self._check_request(request, response_id)
        if not self.has_chat_template:
            raise OpenAIError(
                400,
                f"this model (`{self.model_name}`) has no chat template (a base model); send a "
                "plain prompt to /v1/completions instead",
                param="messages",
                code="no_chat_template",
            )
        # No max_tokens: the reply may run to max_model_len (the engine's None).
        max_tokens = request.max_completion_tokens or request.max_tokens
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        options = _Options(
            logprobs=top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
            continuous_usage=request.continuous_usage,
        )
        params = SamplingParams(
            **request.sampling_kwargs(),
            max_tokens=max_tokens,
            logprobs=top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
        )
        stream, prompts = await self._start(
            response_id, [lambda s: _chat_prompt(s, request)], request, params
        )
        created, model = now(), self.model_name

        def logprobs_of(sample: _Sample, start: int) -> ChatLogProbs | None:
            if options.logprobs is None:
                return None
            return _chat_logprobs(
                sample.token_ids[start:], sample.logprobs[start:], options.logprobs
            )

        if not request.stream:
            await self._collect(stream, prompts, raw_request, options)
            _raise_if_failed(prompts)
            choices = [
                ChatChoice(
                    index=s.index,
                    message=ChatResponseMessage(content=s.text),
                    logprobs=logprobs_of(s, 0),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
                for s in _choices_in_order(prompts)
            ]
            response = ChatCompletionResponse(
                id=response_id,
                created=created,
                model=model,
                choices=choices,
                usage=_usage(prompts, options),
                prompt_logprobs=(
                    None
                    if options.prompt_logprobs is None
                    else _vllm_prompt_logprobs(prompts[0], options.prompt_logprobs)
                ),
            )
            return JSONResponse(response.model_dump())

        def chunk(choice: ChatChunkChoice) -> str:
            usage = _usage(prompts, options) if options.continuous_usage else None
            body = ChatCompletionChunk(
                id=response_id, created=created, model=model, choices=[choice], usage=usage
            )
            return _sse(chunk_json(body))

        def chunks_of(
            prompt: _Prompt, sample: _Sample, new_text: str, num_new: int, finish: str | None
        ) -> list[str]:
            chunks = []
            if new_text or num_new:
                logprobs = logprobs_of(sample, sample.num_tokens - num_new)
                delta = DeltaMessage(content=new_text)
                chunks.append(
                    chunk(ChatChunkChoice(index=sample.index, delta=delta, logprobs=logprobs))
                )
            if finish is not None:
                chunks.append(
                    chunk(
                        ChatChunkChoice(
                            index=sample.index,
                            delta=DeltaMessage(),
                            finish_reason=finish,
                            stop_reason=sample.stop_reason,
                        )
                    )
                )
            return chunks

        def usage_chunk(usage: UsageInfo) -> str:
            body = ChatCompletionChunk(
                id=response_id, created=created, model=model, choices=[], usage=usage
            )
            return _sse(chunk_json(body))

        first = [
            chunk(ChatChunkChoice(index=s.index, delta=DeltaMessage(role="assistant", content="")))
            for s in _choices_in_order(prompts)
        ]
        events = self._sse_stream(
            stream,
            prompts,
            options,
            first,
            chunks_of,
            usage_chunk if request.include_usage else None,
        )
        return StreamingResponse(events, media_type="text/event-stream")

    # ---- tokenizer routes (vLLM's) --------------------------------------------------------------

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self._check_model(request.model)
        request.check_supported()

        def run(engine: Any) -> tuple[list[int], list[str] | None]:
            tokenizer = engine.tokenizer
            if request.messages is not None:
                text = tokenizer.apply_chat_template(
                    [m.as_template_dict() for m in request.messages],
                    add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message,
                    tokenize=False,
                )
                add_special = bool(request.add_special_tokens)
            else:
                text = request.prompt
                add_special = request.add_special_tokens is not False
            ids = tokenizer.encode(text, add_special_tokens=add_special)
            strs = tokenizer.decode_tokens(ids) if request.return_token_strs else None
            return ids, strs

        ids, strs = await self.engine_loop.call(run)
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(request.model)
        tokens = list(request.tokens)

        def run(engine: Any) -> str:
            # Without a known vocabulary, the tokenizer's own limit: ids are 32-bit there.
            vocab_size = _vocab_size(engine)
            limit = vocab_size if vocab_size is not None else 2**31
            if any(not 0 <= t < limit for t in tokens):
                raise InvalidRequestError(
                    f"tokens must be in [0, {limit}) (the vocabulary)", param="tokens"
                )
            return engine.tokenizer.decode(tokens, skip_special_tokens=False)

        return DetokenizeResponse(prompt=await self.engine_loop.call(run))

    async def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``GET /tokenizer_info``: what a client needs to tokenize as the server does
        (evaluation harnesses use it with /tokenize and /detokenize)."""

        def run(engine: Any) -> dict[str, Any]:
            hf = getattr(engine.tokenizer, "hf_tokenizer", None)
            info: dict[str, Any] = {
                "tokenizer_class": type(hf or engine.tokenizer).__name__,
                "model_max_length": self.max_model_len,
                "vocab_size": _vocab_size(engine),
            }
            for name in ("eos_token", "bos_token", "pad_token", "unk_token", "chat_template"):
                value = getattr(hf, name, None)
                info[name] = value if isinstance(value, str) or value is None else str(value)
            return info

        return await self.engine_loop.call(run)

    def models(self) -> ModelList:
        return ModelList(data=[self.model_card()])

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=now(), max_model_len=self.max_model_len)


def _vocab_size(engine: Any) -> int | None:
    config = getattr(engine, "model_config", None)
    size = getattr(config, "vocab_size", None)
    return size if size is not None else getattr(engine.tokenizer, "vocab_size", None)


def _reset_prefix_cache(engine: Any) -> bool:
    """Drop every cached block (only possible while no block is in use)."""
    reset = getattr(engine, "reset_prefix_cache", None)
    if reset is None:  # LLMEngine without its own method: ask its KV-cache manager
        reset = engine.kv_cache_manager.reset_prefix_cache
    return bool(reset())


#: What each union-typed request field accepts, for the 400 message of a value that fits none.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text content parts",
}


def _is_union_tag(part: str) -> bool:
    """pydantic's tag of a union member in an error location (``str``, ``list[int]``,
    ``function-after[...]``), as opposed to a field name or a list index."""
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first pydantic error as one readable message (``field: problem (got value)``)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(
            400,
            f"malformed JSON body: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
            code="invalid_json",
        )
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # A union field's errors carry the member's type tag in their location
    # (`prompt.function-after[_valid_unicode(), str]`): name the field and what it accepts.
    tagged = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tagged is not None:
        # A member whose shape fitted and whose value did not (a negative token id) says more
        # than "not a string": report that one, at its place without the tags.
        prefix = loc[:tagged]
        for error in errors:
            error_loc = [str(part) for part in error.get("loc", ()) if part != "body"]
            kind = str(error.get("type", ""))
            if error_loc[:tagged] == prefix and not kind.endswith(("_type", "_parsing")):
                first = error
                loc = [part for part in error_loc if not _is_union_tag(part)]
                tagged = None
                break
        else:
            loc = prefix
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    if first.get("type") == "missing":
        return OpenAIError(
            400, f"missing required field `{where}`", param=param, code="missing_field"
        )
    message = f"{where}: {first.get('msg', 'invalid value')}"
    if tagged is not None and loc and loc[-1] in _UNION_FIELDS:
        message = f"{where}: must be {_UNION_FIELDS[loc[-1]]}"
    if "input" in first and first.get("type") != "missing":
        message += f" (got {json.dumps(first['input'], default=str)[:200]})"
    return OpenAIError(400, message, param=param, code="invalid_value")


def create_app(
    engine: Any,
    *,
    model_name: str,
    max_model_len: int | None = None,
    log_stats_interval: float | None = None,
    engine_loop: Any = None,
    options: ServerOptions | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` (see :class:`OpenAIServing` for the
    arguments). The engine thread starts and stops with the app (ASGI lifespan).

    Args:
        log_stats_interval: seconds between two stats log lines (throughput, running / waiting,
            KV usage, prefix hit rate; :mod:`.stats_logger`); None = no stats lines.
        engine_loop: the loop that drives the engine (default: one engine thread); the cluster
            front end passes its own.
        options: security and limits (server_options.py); None: ``ServerOptions()`` (no API
            key, admin routes off, 32 MiB / 30 s bodies, no other web origin).
    """
    serving = OpenAIServing(
        engine, model_name=model_name, max_model_len=max_model_len, engine_loop=engine_loop
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        serving.engine_loop.start(asyncio.get_running_loop())
        stats_task = None
        if log_stats_interval is not None:
            stats_logger = StatsLogger(
                lambda: serving.engine_loop.call(lambda engine: engine.get_stats().scheduler),
                log_stats_interval,
            )
            stats_task = asyncio.create_task(stats_logger.run())
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats_task
            serving.engine_loop.stop()

    app = FastAPI(title="pagedkv", lifespan=lifespan)
    app.state.serving = serving
    options = install_middleware(app, options)  # security and limits: server_options.py

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _engine_rejected(request: Request, exc: InvalidRequestError) -> JSONResponse:
        param = getattr(exc, "param", None)
        return OpenAIError(400, str(exc), param=param, code="invalid_request").response()

    @app.exception_handler(UnsupportedFieldError)
    async def _unsupported(request: Request, exc: UnsupportedFieldError) -> JSONResponse:
        return OpenAIError(400, exc.message, param=exc.param, code="unsupported_field").response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return OpenAIError(503, str(exc)).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = OpenAIError(exc.status_code, str(exc.detail))  # headers kept: 405's Allow
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        serving._check_model(model_id)
        return serving.model_card()

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return await serving.tokenizer_info()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await serving.completions(request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await serving.chat_completions(request, raw_request)

    @app.get("/health")
    async def health() -> Response:
        loop = serving.engine_loop
        if loop.is_alive:
            return Response(status_code=200)
        return OpenAIError(503, f"the engine is not running: {loop.status_reason}").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await serving.engine_loop.call(lambda engine: engine.get_stats())
        return Response(serving.metrics.render(stats), media_type=CONTENT_TYPE)

    if options.enable_admin_routes:  # admin routes: server_options.ADMIN_ROUTES

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> JSONResponse:
            success = await serving.engine_loop.call(_reset_prefix_cache)
            return JSONResponse({"success": success}, status_code=200 if success else 409)

    return app
