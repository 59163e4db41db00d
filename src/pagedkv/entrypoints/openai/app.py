"""The FastAPI app of `pagedkv serve`: OpenAI-compatible routes, streaming, abort on disconnect.

Routes::

    GET  /v1/models              the one served model
    POST /v1/completions         text completion (stream: server-sent events)
    POST /v1/chat/completions    chat completion, the model's chat template applied
    GET  /health                 200 while the engine thread runs, else 503
    GET  /metrics                Prometheus text format (see metrics.py)
    POST /reset_prefix_cache     {"success": bool}; fails while blocks are in use

Each of the ``n`` samples of each prompt is its own engine request (ids ``<response id>-<prompt
index>-<sample index>``, choice index ``prompt index * n + sample index``); they share the
prompt's cached blocks through the prefix cache. With a ``seed``, sample i uses ``seed + i`` so
that samples differ and the response is still reproducible.

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

from pagedkv.entrypoints.openai.engine_loop import EngineLoop, EngineRequest, OutputStream
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
from pagedkv.errors import InvalidRequestError

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


def output_delta(output: Any) -> tuple[str, int]:
    """The text and the number of tokens an incremental RequestOutput adds."""
    return output.text, len(output.token_ids)


@dataclass(slots=True)
class _Sample:
    """What the server tracks of one engine request (one choice of the response)."""

    index: int
    prompt_index: int
    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    last_token_time: float = 0.0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def _usage(samples: list[_Sample]) -> UsageInfo:
    """Usage of a response: each prompt counted once however many samples it had."""
    first_of_prompt: dict[int, _Sample] = {}
    for sample in samples:
        first_of_prompt.setdefault(sample.prompt_index, sample)
    num_prompt = sum(s.num_prompt_tokens or 0 for s in first_of_prompt.values())
    cached = [s.num_cached_tokens for s in first_of_prompt.values()]
    num_cached = None if any(c is None for c in cached) else sum(cached)
    return make_usage(num_prompt, sum(s.num_tokens for s in samples), num_cached)


def _finish_reason(reason: Any) -> str | None:
    """The OpenAI finish reason of an engine finish reason (an enum or a string)."""
    if reason is None:
        return None
    name = str(getattr(reason, "value", reason)).lower()
    return "length" if "length" in name else "stop"


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class OpenAIServing:
    """The request handling behind the routes; owns the engine loop and the metrics.

    Args:
        engine: the engine (see :class:`EngineLoop` for what it must offer).
        model_name: the name clients use in ``model``; other names get 404.
        tokenizer: ``apply_chat_template(messages, add_generation_prompt=True) -> list[int]``;
            needed for chat.
        max_model_len: the longest sequence (prompt + output tokens) the engine serves; a chat
            request without max_tokens may generate up to it.
        make_sampling_params: builds the engine's SamplingParams from keyword arguments
            (temperature, top_p, top_k, max_tokens, stop, seed, ignore_eos, n).
    """

    def __init__(
        self,
        engine: Any,
        *,
        model_name: str,
        tokenizer: Any,
        max_model_len: int | None,
        make_sampling_params: Callable[..., Any],
    ) -> None:
        self.engine_loop = EngineLoop(engine)
        self.metrics = ServerMetrics(model_name)
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.make_sampling_params = make_sampling_params

    # ---- request -> engine requests -----------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def _engine_requests(
        self, response_id: str, prompts: list[Any], request: Any, max_tokens: list[int | None]
    ) -> tuple[list[EngineRequest], list[_Sample]]:
        engine_requests, samples = [], []
        for prompt_index, prompt in enumerate(prompts):
            for i in range(request.n):
                params = self.make_sampling_params(
                    n=1,
                    temperature=request.temperature,
                    top_p=request.top_p,
                    top_k=request.top_k,
                    max_tokens=max_tokens[prompt_index],
                    stop=request.stop,
                    seed=None if request.seed is None else request.seed + i,
                    ignore_eos=request.ignore_eos,
                )
                request_id = f"{response_id}-{prompt_index}-{i}"
                engine_requests.append(
                    EngineRequest(request_id, prompt, params, {"cache_salt": request.cache_salt})
                )
                samples.append(_Sample(prompt_index * request.n + i, prompt_index))
        return engine_requests, samples

    def _chat_prompt(self, request: ChatCompletionRequest) -> tuple[list[int], int | None]:
        """The prompt token ids (chat template applied) and max_tokens for the engine."""
        if self.tokenizer is None:
            raise OpenAIError(400, "this server has no tokenizer, so no chat template")
        try:
            prompt_token_ids = list(
                self.tokenizer.apply_chat_template(
                    request.template_messages(), add_generation_prompt=True
                )
            )
        except Exception as exc:  # a template may reject e.g. roles out of order
            raise OpenAIError(
                400, f"cannot apply the chat template: {exc}", param="messages"
            ) from exc
        max_tokens = request.max_completion_tokens or request.max_tokens
        num_prompt_tokens = len(prompt_token_ids)
        if self.max_model_len is not None:
            budget = self.max_model_len - num_prompt_tokens
            if budget < 1 or (max_tokens is not None and max_tokens > budget):
                requested = num_prompt_tokens + (max_tokens or 1)
                raise OpenAIError(
                    400,
                    f"This model's maximum context length (max_model_len) is "
                    f"{self.max_model_len} tokens. However, you requested {requested} tokens "
                    f"({num_prompt_tokens} in the messages, {max_tokens or 1} in the "
                    f"completion). Please reduce the length of the messages or completion.",
                    param="messages",
                    code="context_length_exceeded",
                )
            if max_tokens is None:
                max_tokens = budget
        return prompt_token_ids, max_tokens

    async def _start(self, engine_requests: list[EngineRequest]) -> OutputStream:
        try:
            return await self.engine_loop.add_requests(engine_requests)
        except InvalidRequestError as exc:
            raise OpenAIError(400, str(exc), code="invalid_request") from exc

    # ---- engine outputs -----------------------------------------------------------------------

    async def _events(
        self, stream: OutputStream, samples: dict[str, _Sample]
    ) -> AsyncIterator[tuple[_Sample, str, bool]]:
        """Yields (sample, new text, finished) per engine output, observing metrics."""
        metrics = self.metrics
        while not stream.finished:
            output, step_time = await stream.get()
            sample = samples[output.request_id]
            if sample.num_prompt_tokens is None:
                sample.num_prompt_tokens = len(output.prompt_token_ids)
                sample.num_cached_tokens = getattr(output, "num_cached_tokens", None)
                metrics.prompt_tokens.inc(sample.num_prompt_tokens)
            new_text, num_new_tokens = output_delta(output)
            if num_new_tokens:
                if sample.num_tokens == 0:
                    metrics.time_to_first_token.observe(step_time - stream.arrival_time)
                else:
                    metrics.inter_token_latency.observe(step_time - sample.last_token_time)
                sample.last_token_time = step_time
                sample.num_tokens += num_new_tokens
                metrics.generation_tokens.inc(num_new_tokens)
            if new_text:
                sample.text_parts.append(new_text)
            if output.finished:
                sample.finish_reason = _finish_reason(output.finish_reason)
                metrics.observe_finished(sample.finish_reason, step_time - stream.arrival_time)
            yield sample, new_text, output.finished

    def _abort_unfinished(self, samples: dict[str, _Sample]) -> None:
        unfinished = [rid for rid, s in samples.items() if s.finish_reason is None]
        if unfinished:
            self.engine_loop.abort(unfinished)
            for _ in unfinished:
                self.metrics.observe_finished("abort", 0.0)

    async def _collect(
        self, stream: OutputStream, samples: dict[str, _Sample], raw_request: Request
    ) -> None:
        """Run a non-streamed request to its end; aborts it if the client disconnects first."""

        async def drain() -> None:
            async for _ in self._events(stream, samples):
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
                self._abort_unfinished(samples)
        if work.done() and not work.cancelled():
            work.result()  # re-raise an engine failure

    # ---- routes ---------------------------------------------------------------------------------

    async def completions(self, request: CompletionRequest, raw_request: Request) -> Response:
        self._check_model(request.model)
        prompts = request.prompts()
        max_tokens = request.max_tokens if request.max_tokens is not None else 16
        response_id = random_id("cmpl")
        engine_requests, sample_list = self._engine_requests(
            response_id, prompts, request, [max_tokens] * len(prompts)
        )
        stream = await self._start(engine_requests)
        samples = {r.request_id: s for r, s in zip(engine_requests, sample_list, strict=True)}
        created = now()
        model = self.model_name

        if not request.stream:
            await self._collect(stream, samples, raw_request)
            choices = [
                CompletionChoice(index=s.index, text=s.text, finish_reason=s.finish_reason)
                for s in sorted(sample_list, key=lambda s: s.index)
            ]
            response = CompletionResponse(
                id=response_id,
                created=created,
                model=model,
                choices=choices,
                usage=_usage(sample_list),
            )
            return JSONResponse(response.model_dump())

        async def sse() -> AsyncIterator[str]:
            try:
                async for sample, new_text, finished in self._events(stream, samples):
                    if not new_text and not finished:
                        continue
                    choice = CompletionChoice(
                        index=sample.index, text=new_text, finish_reason=sample.finish_reason
                    )
                    chunk = CompletionResponse(
                        id=response_id, created=created, model=model, choices=[choice]
                    )
                    yield _sse(chunk.model_dump_json(exclude_none=True))
                if request.include_usage:
                    chunk = CompletionResponse(
                        id=response_id,
                        created=created,
                        model=model,
                        choices=[],
                        usage=_usage(sample_list),
                    )
                    yield _sse(chunk.model_dump_json(exclude_none=True))
            except Exception as exc:  # the engine failed mid-stream: tell the client
                logger.exception("streamed completion failed")
                yield _sse(json.dumps(OpenAIError(500, str(exc)).body()))
            finally:
                self._abort_unfinished(samples)
            yield _sse("[DONE]")

        return StreamingResponse(sse(), media_type="text/event-stream")

    async def chat_completions(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        self._check_model(request.model)
        prompt_token_ids, max_tokens = self._chat_prompt(request)
        response_id = random_id("chatcmpl")
        engine_requests, sample_list = self._engine_requests(
            response_id, [prompt_token_ids], request, [max_tokens]
        )
        stream = await self._start(engine_requests)
        samples = {r.request_id: s for r, s in zip(engine_requests, sample_list, strict=True)}
        created = now()
        model = self.model_name

        if not request.stream:
            await self._collect(stream, samples, raw_request)
            choices = [
                ChatChoice(
                    index=s.index,
                    message=ChatResponseMessage(content=s.text),
                    finish_reason=s.finish_reason,
                )
                for s in sorted(sample_list, key=lambda s: s.index)
            ]
            response = ChatCompletionResponse(
                id=response_id,
                created=created,
                model=model,
                choices=choices,
                usage=_usage(sample_list),
            )
            return JSONResponse(response.model_dump())

        def chunk(index: int, delta: DeltaMessage, finish_reason: str | None = None) -> str:
            choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
            body = ChatCompletionChunk(
                id=response_id, created=created, model=model, choices=[choice]
            )
            return _sse(body.model_dump_json(exclude_none=True))

        async def sse() -> AsyncIterator[str]:
            try:
                for sample in sample_list:
                    yield chunk(sample.index, DeltaMessage(role="assistant", content=""))
                async for sample, new_text, finished in self._events(stream, samples):
                    if new_text:
                        yield chunk(sample.index, DeltaMessage(content=new_text))
                    if finished:
                        yield chunk(sample.index, DeltaMessage(), sample.finish_reason)
                if request.include_usage:
                    body = ChatCompletionChunk(
                        id=response_id,
                        created=created,
                        model=model,
                        choices=[],
                        usage=_usage(sample_list),
                    )
                    yield _sse(body.model_dump_json(exclude_none=True))
            except Exception as exc:
                logger.exception("streamed chat completion failed")
                yield _sse(json.dumps(OpenAIError(500, str(exc)).body()))
            finally:
                self._abort_unfinished(samples)
            yield _sse("[DONE]")

        return StreamingResponse(sse(), media_type="text/event-stream")

    def models(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=self.model_name, created=now(), max_model_len=self.max_model_len)]
        )


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
    tokenizer: Any = None,
    max_model_len: int | None = None,
    make_sampling_params: Callable[..., Any] | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` (see :class:`OpenAIServing` for the
    arguments). The engine thread starts and stops with the app (ASGI lifespan)."""
    if make_sampling_params is None:
        from pagedkv.engine.sampling_params import SamplingParams

        make_sampling_params = SamplingParams
    serving = OpenAIServing(
        engine,
        model_name=model_name,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        make_sampling_params=make_sampling_params,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        serving.engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            serving.engine_loop.stop()

    app = FastAPI(title="pagedkv", lifespan=lifespan)
    app.state.serving = serving

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

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
        success = bool(await serving.engine_loop.call(lambda e: e.reset_prefix_cache()))
        return JSONResponse({"success": success}, status_code=200 if success else 409)

    return app
