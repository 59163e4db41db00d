"""Pooling parameters of one request: an embedding of the prompt instead of generated tokens.

A request with :class:`PoolingParams` (vLLM's name) is prefilled like any prompt (chunked under
the step's token budget, batched with generation requests, its full blocks left in the prefix
cache) and samples no token: it finishes when its prompt is computed, and its output carries the
pooled final hidden state (after the model's final norm, before the LM head), float32
``[hidden_size]``.

The pooling types (llama.cpp's ``--pooling``; vLLM's ``PoolerConfig.pooling_type``)::

    last   the last prompt token's state (vLLM's default for a decoder model: the only
           position that has seen the whole prompt)
    mean   the mean over every prompt position
    cls    the first token's state (the BOS token of most decoder models)

``last`` can start from a prefix-cache hit (its last token is always computed); ``mean`` and
``cls`` need every position's state, so those requests skip the prefix-cache lookup (they still
fill the cache), as vLLM does for pooling other than last.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import InvalidRequestError

#: The pooling types, the default first.
POOLING_TYPES = ("last", "mean", "cls")
#: The pooling of a request that does not say (``serve --pooling``'s default).
DEFAULT_POOLING = "last"


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolingParams:
    """How to pool one request's prompt into one vector.

    Args:
        pooling_type: "last", "mean" or "cls" (see the module docstring).
        normalize: divide the pooled vector by its L2 norm (the default, as vLLM and llama.cpp
            do for embeddings: cosine similarity is then a dot product).

    Raises:
        InvalidRequestError: an unknown pooling type (``param="pooling"``), or a normalize that
            is not a bool (``param="normalize"``).
    """

    pooling_type: str = DEFAULT_POOLING
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}",
                param="pooling",
            )
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(
                f"normalize must be a bool, got {self.normalize!r}", param="normalize"
            )

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """True for mean and cls pooling: every prompt position's state is needed, so none may
        come from the prefix cache."""
        return self.pooling_type != "last"


__all__ = ["DEFAULT_POOLING", "POOLING_TYPES", "PoolingParams"]
