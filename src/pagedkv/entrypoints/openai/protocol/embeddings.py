"""``POST /v1/embeddings``: the request body and the response, as OpenAI's (and vLLM's).

``input`` is a string, a list of strings, token ids, or a list of token-id lists (one embedding
per input, ``index`` in input order). ``encoding_format`` "float" gives each embedding as a
list of numbers, "base64" as the base64 of its little-endian float32 bytes (what OpenAI's client
asks for by default and decodes). An empty string is refused (400 naming ``input``, as OpenAI
answers), and so is ``dimensions`` (no matryoshka truncation: a 400 naming it); ``user`` is
accepted and named in the warning line, as on the other routes. vLLM's ``add_special_tokens``,
``priority`` and ``normalize`` are honoured; its ``truncate_prompt_tokens`` is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from pagedkv.entrypoints.openai.protocol.fields import (
    MAX_TOKEN_IDS,
    Int64,
    Text,
    TokenId,
)
from pagedkv.entrypoints.openai.protocol.refusals import (
    NULL_SCHEMA,
    NoOp,
    Refused,
    UnsupportedFieldError,
)
from pagedkv.entrypoints.openai.protocol.schema import StrictModel

#: Most inputs in one embeddings request (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048

_absent = NoOp(lambda value, request: value is None, NULL_SCHEMA)

#: Known fields of /v1/embeddings that pagedkv refuses when they ask for something.
REFUSED_EMBEDDING: dict[str, Refused] = {
    "dimensions": Refused(
        _absent,
        "dimensions (matryoshka truncation) is not supported by pagedkv: the embedding has "
        "the model's hidden size",
        256,
    ),
    "truncate_prompt_tokens": Refused(_absent, "prompt truncation is not supported by pagedkv", 8),
}

#: A non-empty input text (OpenAI refuses "").
_InputText = Annotated[Text, Field(min_length=1)]
_TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]


class EmbeddingRequest(StrictModel):
    """``POST /v1/embeddings`` (OpenAI's body, plus vLLM's ``add_special_tokens``, ``priority``
    and ``normalize``)."""

    REFUSED: ClassVar[dict[str, Refused]] = REFUSED_EMBEDDING
    IGNORED: ClassVar[tuple[str, ...]] = ("user",)

    input: (
        _InputText
        | Annotated[list[_InputText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | _TokenIds
        | Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    model: Text | None = None
    #: "float": lists of numbers; "base64": little-endian float32 bytes, base64-encoded.
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Any = None
    user: Text | None = None
    #: add the tokenizer's special tokens (BOS) to text inputs (vLLM's).
    add_special_tokens: bool = True
    #: lower = sooner under the server's --policy priority (vLLM's).
    priority: Int64 = 0
    #: L2-normalize each embedding (vLLM's; default true, as OpenAI's are unit vectors).
    normalize: bool = True
    truncate_prompt_tokens: Any = None

    @model_validator(mode="before")
    @classmethod
    def _bound_input(cls, data: Any) -> Any:
        """Refuse an empty string (as OpenAI does), and a list longer than its bound before
        pydantic reads it item by item (a union field is read once per member)."""
        if not isinstance(data, dict):
            return data
        value = data.get("input")
        if value == "" or (isinstance(value, list) and "" in value[:MAX_EMBEDDING_INPUTS]):
            raise UnsupportedFieldError("input", "`input` must not hold an empty string")
        if isinstance(value, list):
            ids = bool(value) and isinstance(value[0], int)
            limit = MAX_TOKEN_IDS if ids else MAX_EMBEDDING_INPUTS
            if len(value) > limit:
                raise UnsupportedFieldError(
                    "input", f"`input` holds {len(value)} items, more than the {limit} allowed"
                )
            for item in value if not ids else ():
                if isinstance(item, list) and len(item) > MAX_TOKEN_IDS:
                    raise UnsupportedFieldError(
                        "input", f"`input`: {len(item)} token ids, more than {MAX_TOKEN_IDS}"
                    )
        return data

    def check_supported(self) -> None:
        """A 400 naming the first refused field that asks for something."""
        for name, refused in self.REFUSED.items():
            value = getattr(self, name)
            if not refused.accepts(value, self):
                raise UnsupportedFieldError(name, f"`{name}`: {refused.why} (got {value!r})")

    def ignored_fields(self) -> list[str]:
        """The known fields set that have no effect (``IGNORED``)."""
        return [name for name in self.IGNORED if getattr(self, name) is not None]

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list, each a string or a list of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


class EmbeddingData(BaseModel):
    """One input's embedding: numbers, or the base64 of its little-endian float32 bytes."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Tokens of the inputs (an embedding generates none)."""

    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    """``{"object": "list", "data": [...], "model", "usage"}`` (OpenAI's; ``id`` and
    ``created`` as vLLM adds them)."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


__all__ = [
    "MAX_EMBEDDING_INPUTS",
    "REFUSED_EMBEDDING",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingUsage",
]
