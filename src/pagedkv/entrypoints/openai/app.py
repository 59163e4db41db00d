"""The FastAPI app of `pagedkv serve`: routes, error handlers and the engine's lifetime.

Routes (docs/server.md has the table): the OpenAI ones (/v1/models, /v1/completions,
/v1/chat/completions, /v1/responses and GET|DELETE /v1/responses/{id}, /v1/embeddings), vLLM's
(/tokenize, /detokenize, /tokenizer_info, /version, /health, /ping), /metrics (Prometheus),
the admin route POST /reset_prefix_cache (only with --enable-admin-routes), /openapi.json and
/docs (openapi.py), and the KV cache view /kv, /kv/state, /kv/events (kv_view.py; off with
--disable-kv-view).

API keys, body limits, the Origin / Host policy and the admin gate: server_options.py
(docs/server.md, "Security and limits").

The handlers live in the serving modules (serving_completion, serving_chat, serving_responses,
serving_embedding, serving_tokenization, serving_models), over an
:class:`~pagedkv.engine.protocol.EngineClient`: one engine's
:class:`~pagedkv.engine.engine_loop.EngineLoop` or a cluster's front end. Prompts are tokenized
on the client's input thread, never between the engine's steps.

Every request field is honoured or refused with a 400 naming it (protocol/; the table is in
docs/server.md); an unknown field is a 400 naming it, and the known fields without effect
(``user``...) are named in one warning line.
Bad input gets the OpenAI error body ``{"error": {"message", "type", "param", "code"}}``; a method
a path does not take gets 405 with ``Allow`` naming those it does. Only an engine fault (see
engine_loop.py) stops the engine: then every route that needs it (completions, chat, /metrics,
/reset_prefix_cache) answers 503, and /health says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedkv import __version__
from pagedkv.engine.protocol import EngineClient, KVStateSource
from pagedkv.entrypoints.openai.chat_options import ChatOptions
from pagedkv.entrypoints.openai.errors import OpenAIError, install_error_handlers
from pagedkv.entrypoints.openai.kv_view import install_kv_view
from pagedkv.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.entrypoints.openai.openapi import install_openapi
from pagedkv.entrypoints.openai.protocol.embeddings import EmbeddingRequest
from pagedkv.entrypoints.openai.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedkv.entrypoints.openai.protocol.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from pagedkv.entrypoints.openai.protocol.responses_api import ResponsesDeleted, ResponsesRequest
from pagedkv.entrypoints.openai.server_options import (
    ServerOptions,
    install_middleware,
    middleware_errors,
)
from pagedkv.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedkv.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedkv.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedkv.entrypoints.openai.serving_models import OpenAIServingModels
from pagedkv.entrypoints.openai.serving_responses import (
    DEFAULT_RESPONSES_STORE_SIZE,
    OpenAIServingResponses,
    ResponseStore,
)
from pagedkv.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedkv.entrypoints.openai.stats_logger import StatsLogger
from pagedkv.pooling_params import DEFAULT_POOLING

logger = logging.getLogger(__name__)


def _lifespan(engine_client: EngineClient, log_stats_interval: float | None):
    """Start the engine client with the app and stop it after; the periodic stats line."""

    async def scheduler_stats() -> Any:
        return (await engine_client.get_stats()).scheduler

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_client.start(asyncio.get_running_loop())
        stats_task = None
        if log_stats_interval is not None:
            stats_task = asyncio.create_task(StatsLogger(scheduler_stats, log_stats_interval).run())
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats_task
            engine_client.stop()

    return lifespan


def create_app(
    engine_client: EngineClient,
    *,
    model_name: str | Sequence[str],
    log_stats_interval: float | None = None,
    options: ServerOptions | None = None,
    chat_options: ChatOptions | None = None,
    metrics_prefix: str = "pagedkv",
    kv_view: KVStateSource | None = None,
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE,
    pooling: str = DEFAULT_POOLING,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine_client``, which starts and stops with the app
    (ASGI lifespan).

    Args:
        engine_client: one engine's :class:`~pagedkv.engine.engine_loop.EngineLoop`, or a
            cluster's :class:`~pagedkv.entrypoints.cluster.frontend.ClusterEngineLoop`.
        model_name: the name clients pass as ``model``, or several (each accepted, the first
            reported); other names get 404.
        log_stats_interval: seconds between two stats log lines (throughput, running / waiting,
            KV usage, prefix hit rate; :mod:`.stats_logger`); None = no stats lines.
        options: API keys, admin routes, body limits, allowed origins
            (:class:`~.server_options.ServerOptions`; default: its defaults).
        chat_options: chat template and tool-call options
            (:class:`~.chat_options.ChatOptions`; default: the model's template, no auto tool
            choice).
        metrics_prefix: the Prometheus names' prefix, ``"pagedkv"`` or ``"vllm"``
            (``--metrics-prefix``, see metrics.py).
        kv_view: where the /kv page's snapshots come from (the engine's
            :class:`~pagedkv.engine.engine_loop.EngineLoop`); None: no /kv routes
            (``--disable-kv-view``, and a cluster's front end).
        responses_store_size: how many Responses API responses are kept for
            ``previous_response_id`` and ``GET /v1/responses/{id}`` (an LRU;
            ``--responses-store-size``); 0 keeps none.
        pooling: how /v1/embeddings pools each input's hidden states: "last" (default),
            "mean" or "cls" (``--pooling``; :mod:`pagedkv.pooling_params`).

    Raises:
        ConfigError: an empty model name, an unknown metrics prefix or a negative store size.
        InvalidRequestError: an unknown pooling.
    """
    chat_options = chat_options or ChatOptions()
    models = OpenAIServingModels(model_name, engine_client.input_processor.max_model_len)
    metrics = ServerMetrics(models.model_name, prefix=metrics_prefix)
    completion = OpenAIServingCompletion(engine_client, models, metrics)
    chat = OpenAIServingChat(engine_client, models, metrics, chat_options=chat_options)
    responses = OpenAIServingResponses(chat, ResponseStore(responses_store_size))
    embedding = OpenAIServingEmbedding(engine_client, models, metrics, pooling=pooling)
    tokenization = OpenAIServingTokenization(
        engine_client, models, chat_template=chat_options.chat_template
    )

    app = FastAPI(title="pagedkv", lifespan=_lifespan(engine_client, log_stats_interval))
    app.state.engine_client = engine_client
    app.state.metrics = metrics
    options = install_middleware(app, options)
    install_error_handlers(app)
    install_openapi(app, engine_client.input_processor, extra_errors=middleware_errors(options))

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return models.models()

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        models.check_model(model_id)
        return models.model_card(model_id)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> ResponsesDeleted:
        return responses.delete(response_id)

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await embedding.create_embedding(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return await tokenization.tokenizer_info()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> Response:
        if engine_client.is_alive:
            return Response(status_code=200)
        return OpenAIError(
            503, f"the engine is not running: {engine_client.status_reason}"
        ).response()

    for method in ("GET", "POST"):  # vLLM's /ping, one operation per method
        app.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        stats = await engine_client.get_stats()
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)

    if kv_view is not None:
        install_kv_view(app, kv_view)

    if options.enable_admin_routes:  # vLLM serves its dev routes only in dev mode

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> JSONResponse:
            success = await engine_client.reset_prefix_cache()
            return JSONResponse({"success": success}, status_code=200 if success else 409)

    return app
