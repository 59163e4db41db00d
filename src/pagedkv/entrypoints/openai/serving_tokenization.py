"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``
(evaluation harnesses use them to tokenize exactly as the server does). They run on the engine
client's input thread, never between the engine's steps."""

from __future__ import annotations

from typing import Any

from pagedkv.engine.input_processor import InputProcessor
from pagedkv.engine.protocol import EngineClient
from pagedkv.entrypoints.openai.protocol.messages import template_tools
from pagedkv.entrypoints.openai.protocol.requests import DetokenizeRequest, TokenizeRequest
from pagedkv.entrypoints.openai.protocol.responses import DetokenizeResponse, TokenizeResponse
from pagedkv.entrypoints.openai.serving_models import OpenAIServingModels


def _tokenize(
    processor: InputProcessor, request: TokenizeRequest, chat_template: str | None
) -> tuple[list[int], list[str] | None]:
    """Runs on the input thread: the request's text or messages -> ids (and token texts)."""
    if request.messages is not None:
        processed = processor.process_chat(
            [m.as_template_dict() for m in request.messages],
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            add_special_tokens=bool(request.add_special_tokens),
            tools=template_tools(request.tools),
            chat_template=chat_template,
        )
    else:
        processed = processor.process_text(
            request.prompt,
            add_special_tokens=request.add_special_tokens is not False,
            allow_empty=True,
        )
    ids = processed.token_ids
    return ids, processor.decode_tokens(ids) if request.return_token_strs else None


class OpenAIServingTokenization:
    """The tokenizer routes over an engine client.

    Args:
        engine_client: whose input processor tokenizes.
        models: the served model (the ``model`` field is checked against it).
        chat_template: the server's ``--chat-template`` (None: the model's), so that chat
            messages tokenize as /v1/chat/completions renders them.
    """

    def __init__(
        self,
        engine_client: EngineClient,
        models: OpenAIServingModels,
        chat_template: str | None = None,
    ) -> None:
        self.engine_client = engine_client
        self.models = models
        self.chat_template = chat_template

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Text, or chat messages through the template -> token ids.

        Raises:
            OpenAIError (404), UnsupportedFieldError, InvalidRequestError (400).
        """
        self.models.check_model(request.model)
        request.check_supported()
        ids, strs = await self.engine_client.process(
            lambda p: _tokenize(p, request, self.chat_template)
        )
        return TokenizeResponse(
            count=len(ids), max_model_len=self.models.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Token ids -> text (special tokens kept).

        Raises:
            OpenAIError (404), InvalidRequestError (400: an id outside the vocabulary).
        """
        self.models.check_model(request.model)
        tokens = list(request.tokens)
        return DetokenizeResponse(
            prompt=await self.engine_client.process(lambda p: p.decode(tokens))
        )

    async def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``GET /tokenizer_info``."""
        return await self.engine_client.process(lambda p: p.tokenizer_info())
