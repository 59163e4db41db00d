"""Prompt lookup decoding: draft the tokens that followed the last n tokens' earlier occurrence.

Saxena 2023 (prompt lookup decoding), vLLM's ``NgramProposer``: find the longest n in
``[prompt_lookup_min, prompt_lookup_max]`` such that the request's last n tokens occur earlier
in its tokens, and draft the (up to ``num_speculative_tokens``) tokens that followed that
occurrence::

    token_ids   a b c d x y a b c d ? ?        last 4 tokens "a b c d" (n = 4)
                ^^^^^^^ -> drafts "x y a b"     (the earliest occurrence, as vLLM)

NOTE: among occurrences of the same length the EARLIEST one is used, as vLLM's KMP search does:
it has the most tokens after it (a later one, near the end, may leave fewer than
``num_speculative_tokens`` to copy), and the drafts equal vLLM's, so acceptance rates compare.
"""

from __future__ import annotations

import numpy as np

from pagedkv.config import SpeculativeConfig
from pagedkv.worker.spec_decode.proposer import TokenProposer

_EMPTY = np.empty(0, dtype=np.int64)


def find_ngram_drafts(
    token_ids: np.ndarray, min_n: int, max_n: int, max_num_tokens: int
) -> np.ndarray:
    """The drafts of prompt lookup decoding (module docstring), numpy over the token array.

    For every earlier end position j, the length of the common suffix of ``token_ids[: j + 1]``
    and ``token_ids`` (up to ``max_n``) comes from ``max_n`` vectorised comparisons of the array
    with a shifted copy of itself: O(max_n x num_tokens) element operations, no Python step per
    token.

    Args:
        token_ids: ``[num_tokens]`` int32 / int64 ids.
        min_n, max_n: the n-gram lengths matched (1 <= min_n <= max_n).
        max_num_tokens: most drafts (>= 0).

    Returns:
        ``[0..max_num_tokens]`` int64 drafts (empty when no n-gram of length >= min_n recurs).
    """
    tokens = np.asarray(token_ids)
    num_tokens = tokens.shape[0]
    max_n = min(max_n, num_tokens - 1)  # an occurrence must end before the last token
    if max_num_tokens <= 0 or max_n < min_n:
        return _EMPTY
    ends = tokens[:-1]  # candidate occurrence ends j = 0 .. num_tokens - 2
    # match[j] = number of d < max_n with tokens[j - d] == tokens[-1 - d] for all smaller d.
    match = np.zeros(num_tokens - 1, dtype=np.int32)
    alive = ends == tokens[-1]
    match += alive
    for d in range(1, max_n):
        if not alive[d:].any():
            break
        # tokens[j - d] for j >= d; positions j < d have no token d back and stop matching.
        alive[:d] = False
        alive[d:] &= tokens[: num_tokens - 1 - d] == tokens[-1 - d]
        match += alive
    longest = int(match.max())
    if longest < min_n:
        return _EMPTY
    start = int(np.argmax(match == longest)) + 1  # the earliest occurrence's next token
    return tokens[start : start + max_num_tokens].astype(np.int64)


class NgramProposer(TokenProposer):
    """A :class:`~pagedkv.worker.spec_decode.proposer.DraftProposer` by prompt lookup
    (stateless: each call searches the request's whole token array)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, req_id: str, token_ids: np.ndarray, max_num_tokens: int) -> np.ndarray:
        """Drafts of :func:`find_ngram_drafts`, at most ``min(max_num_tokens,
        num_speculative_tokens)``."""
        limit = min(max_num_tokens, self.num_speculative_tokens)
        return find_ngram_drafts(token_ids, self.min_n, self.max_n, limit)
