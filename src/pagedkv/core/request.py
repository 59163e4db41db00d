"""The request interface the KV-cache core needs (the engine's Request subclasses it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.core.hashing import BlockHash, BlockHasher
from pagedkv.errors import InvalidRequestError
from pagedkv.validation import check_int, utf8_error


@dataclass(slots=True, eq=False)
class KVCacheRequest:
    """A sequence whose KV the core manages: its token ids, progress and block hashes.

    Args:
        request_id: unique id of the request.
        prompt_token_ids: the prompt (>= 1 token); copied into ``all_token_ids``.
        block_hasher: hashes full blocks for prefix caching (give it
            ``KVCacheManager.block_hasher``); ``None`` = this request neither hits nor fills the
            prefix cache.
        lora_id: LoRA adapter id, part of every block's hash.
        cache_salt: separates this request's cache from others' (hashed into the first block,
            hence into every descendant).
        mm_features: multimodal placeholders ``(mm_hash, offset, length)`` in token positions;
            each block hashes the inputs it overlaps with their offset in the block.
        num_computed_tokens: tokens whose KV is in the cache (the scheduler advances it).
        skip_reading_prefix_cache: the request computes every token of its prompt: it gets no
            prefix-cache hit (``get_computed_blocks`` returns none), but its full blocks still
            enter the cache (a request asking for prompt logprobs needs the logits of every
            prompt position; vLLM V1 does the same).

    Derived:
        all_token_ids: prompt + output token ids.
        block_hashes: hashes of every full block of ``all_token_ids``, computed once per block
            as the sequence grows (empty without a ``block_hasher``).

    Raises:
        InvalidRequestError: an empty prompt or a str prompt; a lora_id that is not an
            int64; a cache_salt (or multimodal hash) that is not a str of valid Unicode text
            (a lone surrogate cannot be encoded as UTF-8); a negative num_computed_tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    block_hasher: BlockHasher | None = None
    lora_id: int | None = None
    cache_salt: str | None = None
    mm_features: tuple[tuple[str, int, int], ...] = ()
    num_computed_tokens: int = 0
    skip_reading_prefix_cache: bool = False
    all_token_ids: list[int] = field(init=False, repr=False)
    block_hashes: list[BlockHash] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.prompt_token_ids, (str, bytes)):
            raise InvalidRequestError(
                f"request {self.request_id!r}: prompt_token_ids must be token ids, not text"
            )
        if len(self.prompt_token_ids) == 0:
            raise InvalidRequestError(f"request {self.request_id!r} has an empty prompt")
        where = f"request {self.request_id!r}: "
        check_int(
            where + "lora_id",
            self.lora_id,
            -(2**63),
            maximum=2**63 - 1,
            optional=True,
            why="int64",
            error=InvalidRequestError,
        )
        if self.cache_salt is not None and not _is_utf8_text(self.cache_salt):
            raise InvalidRequestError(
                f"request {self.request_id!r}: cache_salt must be a str of valid Unicode text "
                f"(the block hash encodes it as UTF-8) or None, got {self.cache_salt!r}",
                param="cache_salt",
            )
        for feature in self.mm_features:
            if not (isinstance(feature, tuple | list) and len(feature) == 3) or not _is_utf8_text(
                feature[0]
            ):
                raise InvalidRequestError(
                    f"request {self.request_id!r}: mm_features must hold (mm_hash, offset, "
                    f"length) with mm_hash a str of valid Unicode text, got {feature!r}"
                )
        check_int(
            where + "num_computed_tokens", self.num_computed_tokens, 0, error=InvalidRequestError
        )
        self.all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = []
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated token ids."""
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def reject_draft_tokens(self, num_rejected_tokens: int) -> None:
        """Roll ``num_computed_tokens`` back past the draft tokens that verification rejected
        (speculative decoding), before appending the accepted ones. O(1).

        A step that computed the request's last verified token and ``k`` draft tokens (which
        are not in ``all_token_ids``) left ``num_computed_tokens = num_tokens + k``; with ``j``
        drafts accepted, ``num_rejected_tokens = k - j``. Then append the ``j`` accepted drafts
        and the bonus token (``append_output_token_ids``): ``num_computed_tokens ==
        num_tokens - 1``. The slots of the rejected drafts stay allocated, and the next step's
        writes overwrite them (docs/core.md, "Draft tokens and rollback"). Idea from vLLM V1
        (``Scheduler.update_from_output``: ``num_computed_tokens -= num_rejected``).

        Raises:
            InvalidRequestError: ``num_rejected_tokens`` not an int in ``0 ..
                num_computed_tokens - num_tokens`` (only draft tokens can be rejected: a
                verified token's KV is never given up); nothing changed.
        """
        num_drafts = max(0, self.num_computed_tokens - len(self.all_token_ids))
        check_int(
            f"request {self.request_id!r}: num_rejected_tokens",
            num_rejected_tokens,
            0,
            maximum=num_drafts,
            why=f"{num_drafts} draft tokens computed past the verified ones",
            error=InvalidRequestError,
        )
        self.num_computed_tokens -= num_rejected_tokens

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated token(s) and hash the blocks they fill.

        Raises:
            InvalidRequestError: a token id the block hash cannot encode; nothing is appended.
        """
        all_token_ids = self.all_token_ids
        num_tokens = len(all_token_ids)
        if isinstance(token_ids, int):
            all_token_ids.append(token_ids)
        else:
            all_token_ids.extend(token_ids)
        hasher = self.block_hasher
        if hasher is not None and len(all_token_ids) >= (len(self.block_hashes) + 1) * (
            hasher.block_size
        ):
            try:
                new_hashes = hasher(self)
            except Exception as e:
                del all_token_ids[num_tokens:]
                raise InvalidRequestError(
                    f"request {self.request_id!r}: cannot hash the new token ids: {e}"
                ) from None
            self.block_hashes.extend(new_hashes)


def _is_utf8_text(value: object) -> bool:
    """A str that UTF-8 can encode (no lone surrogates)."""
    return isinstance(value, str) and utf8_error(value) is None
