"""The FastAPI app of `pagedkv serve`: OpenAI-compatible routes, streaming, abort on disconnect.

Routes::

    GET  /v1/models              the one served model
    POST /v1/completions         text completion (stream: server-sent events)
    POST /v1/chat/completions    chat completion, the model's chat template applied (400 for
                                 a base model without one: use /v1/completions)
    GET  /health                 200 while the engine thread runs, else 503
    GET  /metrics                Prometheus text format (see metrics.py)
    POST /reset_prefix_cache     {"success": bool}; fails while blocks are in use

Each prompt is one engine request (id ``<response id>-<prompt index>``) with the request's ``n``
samples, which share the prompt's cached blocks; choice index = prompt index * n + sample index.
With a ``seed``, the engine seeds sample i with ``seed + i``, so samples differ and the response
is still reproducible. Chat messages go to the engine as they are; it applies the chat template.

A request whose client goes away (mid-stream, or while waiting for a non-streamed answer) is
aborted in the engine, which frees its blocks. Bad input gets the OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
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

from pagedkv.entrypoints.openai.engine_loop import (
    EngineDeadError,
    EngineLoop,
    EngineRequest,
    OutputStream,
)
from pagedkv.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    make_usage,
    now,
    random_id,
)
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
    num_tokens: int = 0
    finish_reason: str | None = None
    last_token_time: float = 0.0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass(slots=True)
class _Prompt:
    """One engine request: a prompt with its n samples."""

    request_id: str
    samples: list[_Sample]
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


def _usage(prompts: list[_Prompt]) -> UsageInfo:
    """Usage of a response: each prompt counted once however many samples it had."""
    num_prompt = sum(p.num_prompt_tokens or 0 for p in prompts)
    num_completion = sum(s.num_tokens for p in prompts for s in p.samples)
    cached = [p.num_cached_tokens for p in prompts]
    num_cached = None if None in cached else sum(cached)
    return make_usage(num_prompt, num_completion, num_cached)


def _choices_in_order(prompts: list[_Prompt]) -> list[_Sample]:
    return sorted((s for p in prompts for s in p.samples), key=lambda s: s.index)


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class OpenAIServing:
    """The request handling behind the routes; owns the engine loop and the metrics.

    Args:
        engine: the engine (see :class:`EngineLoop` for what it must offer).
        model_name: the name clients use in ``model``; other names get 404.
        max_model_len: shown by /v1/models.
    """

    def __init__(self, engine: Any, *, model_name: str, max_model_len: int | None) -> None:
        self.engine_loop = EngineLoop(engine)
        tokenizer = getattr(engine, "tokenizer", None)
        #: False for a base model (Gemma 3 270M): chat requests are refused up front.
        self.has_chat_template = bool(getattr(tokenizer, "has_chat_template", True))
        self.metrics = ServerMetrics(model_name)
        self.model_name = model_name
        self.max_model_len = max_model_len

    # ---- request -> engine requests -----------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    async def _start(
        self, response_id: str, prompts: list[Any], request: Any, max_tokens: int | None
    ) -> tuple[OutputStream, list[_Prompt]]:
        """Add one engine request (with n samples) per prompt; returns their shared stream.

        Raises:
            InvalidRequestError: invalid sampling parameters, or a prompt the engine can never
                serve (longer than max_model_len with max_tokens); nothing is left queued.
        """
        params = SamplingParams(
            n=request.n,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            max_tokens=max_tokens,
            stop=request.stop,
            seed=request.seed,
            ignore_eos=request.ignore_eos,
        )
        engine_requests, states = [], []
        for prompt_index, prompt in enumerate(prompts):
            request_id = f"{response_id}-{prompt_index}"
            kwargs = {"cache_salt": request.cache_salt}
            engine_requests.append(EngineRequest(request_id, prompt, params, kwargs))
            samples = [_Sample(prompt_index * request.n + i) for i in range(request.n)]
            states.append(_Prompt(request_id, samples))
        stream = await self.engine_loop.add_requests(engine_requests)
        return stream, states

    # ---- engine outputs -----------------------------------------------------------------------

    async def _events(
        self, stream: OutputStream, prompts: list[_Prompt]
    ) -> AsyncIterator[tuple[_Sample, str]]:
        """Yields (sample, new text) whenever a sample gets text or finishes; observes the
        metrics. Ends when every sample has finished."""
        metrics = self.metrics
        by_id = {p.request_id: p for p in prompts}
        while not stream.finished:
            output, step_time = await stream.get()
            prompt = by_id[output.request_id]
            if prompt.num_prompt_tokens is None:
                prompt.num_prompt_tokens = len(output.prompt_token_ids)
                prompt.num_cached_tokens = output.num_cached_tokens
                metrics.prompt_tokens.inc(prompt.num_prompt_tokens)
            for completion in output.outputs:
                sample = prompt.samples[completion.index]
                if sample.finish_reason is not None:
                    continue
                num_new_tokens = len(completion.new_token_ids)
                if num_new_tokens:
                    if sample.num_tokens == 0:
                        metrics.time_to_first_token.observe(step_time - stream.arrival_time)
                    else:
                        metrics.inter_token_latency.observe(step_time - sample.last_token_time)
                    sample.last_token_time = step_time
                    sample.num_tokens += num_new_tokens
                    metrics.generation_tokens.inc(num_new_tokens)
                if completion.new_text:
                    sample.text_parts.append(completion.new_text)
                if completion.finish_reason is not None:
                    sample.finish_reason = completion.finish_reason
                    metrics.observe_finished(sample.finish_reason, step_time - stream.arrival_time)
                if completion.new_text or sample.finish_reason is not None:
                    yield sample, completion.new_text

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
        self, stream: OutputStream, prompts: list[_Prompt], raw_request: Request
    ) -> None:
        """Run a non-streamed request to its end; aborts it if the client disconnects first."""

        async def drain() -> None:
            async for _ in self._events(stream, prompts):
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
        first_chunks: list[str],
        chunks_of: Callable[[_Sample, str], list[str]],
        usage_chunk: Callable[[UsageInfo], str] | None,
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed response, ending with ``data: [DONE]``; the
        engine requests are aborted if the client goes away first."""
        try:
            for chunk in first_chunks:
                yield chunk
            async for sample, new_text in self._events(stream, prompts):
                for chunk in chunks_of(sample, new_text):
                    yield chunk
            if usage_chunk is not None:
                yield usage_chunk(_usage(prompts))
        except Exception as exc:  # the engine failed mid-stream: tell the client
            logger.exception("streamed request failed")
            yield _sse(json.dumps(OpenAIError(500, str(exc)).body()))
        finally:
            self._abort_unfinished(prompts)
        yield _sse("[DONE]")

    # ---- routes ---------------------------------------------------------------------------------

    async def completions(self, request: CompletionRequest, raw_request: Request) -> Response:
        self._check_model(request.model)
        response_id = random_id("cmpl")
        max_tokens = request.max_tokens if request.max_tokens is not None else 16
        stream, prompts = await self._start(response_id, request.prompts(), request, max_tokens)
        created, model = now(), self.model_name

        if not request.stream:
            await self._collect(stream, prompts, raw_request)
            choices = [
                CompletionChoice(index=s.index, text=s.text, finish_reason=s.finish_reason)
                for s in _choices_in_order(prompts)
            ]
            response = CompletionResponse(
                id=response_id,
                created=created,
                model=model,
                choices=choices,
                usage=_usage(prompts),
            )
            return JSONResponse(response.model_dump())

        def chunks_of(sample: _Sample, new_text: str) -> list[str]:
            choice = CompletionChoice(
                index=sample.index, text=new_text, finish_reason=sample.finish_reason
            )
            body = CompletionResponse(
                id=response_id, created=created, model=model, choices=[choice]
            )
            return [_sse(body.model_dump_json(exclude_none=True))]

        def usage_chunk(usage: UsageInfo) -> str:
            body = CompletionResponse(
                id=response_id, created=created, model=model, choices=[], usage=usage
            )
            return _sse(body.model_dump_json(exclude_none=True))

        events = self._sse_stream(
            stream, prompts, [], chunks_of, usage_chunk if request.include_usage else None
        )
        return StreamingResponse(events, media_type="text/event-stream")

    async def chat_completions(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        self._check_model(request.model)
        if not self.has_chat_template:
            raise OpenAIError(
                400,
                f"this model (`{self.model_name}`) has no chat template (a base model); send a "
                "plain prompt to /v1/completions instead",
                param="messages",
                code="no_chat_template",
            )
        response_id = random_id("chatcmpl")
        # No max_tokens: the reply may run to max_model_len (the engine's None).
        max_tokens = request.max_completion_tokens or request.max_tokens
        stream, prompts = await self._start(
            response_id, [request.template_messages()], request, max_tokens
        )
        created, model = now(), self.model_name

        if not request.stream:
            await self._collect(stream, prompts, raw_request)
            choices = [
                ChatChoice(
                    index=s.index,
                    message=ChatResponseMessage(content=s.text),
                    finish_reason=s.finish_reason,
                )
                for s in _choices_in_order(prompts)
            ]
            response = ChatCompletionResponse(
                id=response_id,
                created=created,
                model=model,
                choices=choices,
                usage=_usage(prompts),
            )
            return JSONResponse(response.model_dump())

        def chunk(index: int, delta: DeltaMessage, finish_reason: str | None = None) -> str:
            choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
            body = ChatCompletionChunk(
                id=response_id, created=created, model=model, choices=[choice]
            )
            return _sse(body.model_dump_json(exclude_none=True))

        def chunks_of(sample: _Sample, new_text: str) -> list[str]:
            chunks = [chunk(sample.index, DeltaMessage(content=new_text))] if new_text else []
            if sample.finish_reason is not None:
                chunks.append(chunk(sample.index, DeltaMessage(), sample.finish_reason))
            return chunks

        def usage_chunk(usage: UsageInfo) -> str:
            body = ChatCompletionChunk(
                id=response_id, created=created, model=model, choices=[], usage=usage
            )
            return _sse(body.model_dump_json(exclude_none=True))

        first = [
            chunk(s.index, DeltaMessage(role="assistant", content=""))
            for s in _choices_in_order(prompts)
        ]
        events = self._sse_stream(
            stream, prompts, first, chunks_of, usage_chunk if request.include_usage else None
        )
        return StreamingResponse(events, media_type="text/event-stream")

    def models(self) -> ModelList:
        card = ModelCard(id=self.model_name, created=now(), max_model_len=self.max_model_len)
        return ModelList(data=[card])


def _reset_prefix_cache(engine: Any) -> bool:
    """Drop every cached block (only possible while no block is in use)."""
    reset = getattr(engine, "reset_prefix_cache", None)
    if reset is None:  # LLMEngine without its own method: ask its KV-cache manager
        reset = engine.kv_cache_manager.reset_prefix_cache
    return bool(reset())


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
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    if first.get("type") == "missing":
        return OpenAIError(
            400, f"missing required field `{where}`", param=param, code="missing_field"
        )
    message = f"{where}: {first.get('msg', 'invalid value')}"
    if "input" in first and first.get("type") != "missing":
        message += f" (got {json.dumps(first['input'], default=str)[:200]})"
    return OpenAIError(400, message, param=param, code="invalid_value")


def create_app(
    engine: Any,
    *,
    model_name: str,
    max_model_len: int | None = None,
    log_stats_interval: float | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` (see :class:`OpenAIServing` for the
    arguments). The engine thread starts and stops with the app (ASGI lifespan).

    Args:
        log_stats_interval: seconds between two stats log lines (throughput, running / waiting,
            KV usage, prefix hit rate; :mod:`.stats_logger`); None = no stats lines.
    """
    serving = OpenAIServing(engine, model_name=model_name, max_model_len=max_model_len)

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

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _engine_rejected(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return OpenAIError(400, str(exc), code="invalid_request").response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return OpenAIError(503, str(exc)).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return serving.models()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await serving.completions(request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await serving.chat_completions(request, raw_request)

    @app.get("/health")
    async def health() -> Response:
        if serving.engine_loop.is_alive:
            return Response(status_code=200)
        return OpenAIError(503, "the engine is not running").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await serving.engine_loop.call(lambda engine: engine.get_stats())
        return Response(serving.metrics.render(stats), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        success = await serving.engine_loop.call(_reset_prefix_cache)
        return JSONResponse({"success": success}, status_code=200 if success else 409)

    return app
