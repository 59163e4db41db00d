"""``POST /v1/embeddings``: one pooling request per input through the same engine, scheduler, KV
pool and prefix cache as generation (vLLM's pooling requests). Each input is prefilled and its
final hidden state pooled (the server's ``--pooling``: last, mean or cls) and L2-normalized
unless ``normalize`` is false; the response has OpenAI's shape (floats, or base64 of
little-endian float32 bytes)."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedkv.engine.input_processor import InputProcessor, ProcessedPrompt
from pagedkv.engine.protocol import EngineClient, EngineRequest
from pagedkv.entrypoints.openai.metrics import ServerMetrics
from pagedkv.entrypoints.openai.protocol.embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagedkv.entrypoints.openai.protocol.responses import now, random_id
from pagedkv.entrypoints.openai.serving_engine import (
    OpenAIServing,
    Options,
    PromptState,
    Sample,
    raise_if_failed,
)
from pagedkv.entrypoints.openai.serving_models import OpenAIServingModels
from pagedkv.errors import InvalidRequestError
from pagedkv.pooling_params import DEFAULT_POOLING, PoolingParams
from pagedkv.sampling_params import SamplingParams


def _process_inputs(processor: InputProcessor, request: EmbeddingRequest) -> list[ProcessedPrompt]:
    """Runs on the input thread: every input tokenized and checked (at most max_model_len
    tokens, ids in the vocabulary); a 400 names ``input``."""
    result = []
    for item in request.inputs():
        if isinstance(item, str):
            processed = processor.process_text(
                item, add_special_tokens=request.add_special_tokens, param="input"
            )
        else:
            processed = processor.process_token_ids(item, param="input")
        result.append(processed)
    return result


def encode_embedding(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A float32 ``[hidden_size]`` vector as OpenAI sends it: a list of numbers ("float"), or
    the base64 of its little-endian float32 bytes ("base64")."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vector, dtype=np.float32).tolist()


class OpenAIServingEmbedding(OpenAIServing):
    """``/v1/embeddings`` over an engine client (see :class:`OpenAIServing`).

    Args:
        pooling: how each input's hidden states are pooled: "last" (default), "mean" or "cls"
            (``serve --pooling``; :mod:`pagedkv.pooling_params`).

    Raises:
        InvalidRequestError: an unknown pooling.
    """

    def __init__(
        self,
        engine_client: EngineClient,
        models: OpenAIServingModels,
        metrics: ServerMetrics,
        *,
        pooling: str = DEFAULT_POOLING,
    ) -> None:
        super().__init__(engine_client, models, metrics)
        PoolingParams(pooling_type=pooling)  # checked once, at start-up
        self.pooling = pooling

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        """Embed every input of ``request``; the JSON body, inputs in order.

        Raises:
            OpenAIError, UnsupportedFieldError, InvalidRequestError: 4xx naming the field.
            EngineDeadError: the engine is not serving (503).
        """
        response_id = random_id("embd")
        self.check_request(request, response_id)
        # No tokenizer involved: the priority's rule (--policy priority), on the event loop.
        self.engine_client.input_processor.check_params(SamplingParams(), request.priority)
        processed = await self.engine_client.process(
            lambda processor: _process_inputs(processor, request)
        )
        params = PoolingParams(pooling_type=self.pooling, normalize=request.normalize)
        engine_requests, prompts = [], []
        for index, prompt in enumerate(processed):
            request_id = f"{response_id}-{index}"
            prompts.append(
                PromptState(
                    request_id, [Sample(index)], prompt, num_prompt_tokens=len(prompt.token_ids)
                )
            )
            engine_requests.append(
                EngineRequest(request_id, prompt, params, priority=request.priority)
            )
        try:
            stream = await self.engine_client.add_requests(engine_requests)
        except InvalidRequestError as exc:
            if exc.param in (None, "prompt", "max_tokens"):
                exc.param = "input"  # an input that can never fit the KV cache
            raise
        await self.collect(stream, prompts, raw_request, Options())
        raise_if_failed(prompts)
        if any(prompt.embedding is None for prompt in prompts):
            # The client went away first and its requests were aborted: no vector to send,
            # and nobody to send one to (nginx's 499, "client closed request").
            return Response(status_code=499)
        data = [
            EmbeddingData(
                index=index, embedding=encode_embedding(prompt.embedding, request.encoding_format)
            )
            for index, prompt in enumerate(prompts)
        ]
        num_tokens = sum(p.num_prompt_tokens for p in prompts)
        body = EmbeddingResponse(
            id=response_id,
            created=now(),
            model=self.models.model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(body.model_dump())
