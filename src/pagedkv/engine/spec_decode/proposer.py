"""The interface the scheduler calls to draft tokens for a request (vLLM V1's proposers)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagedkv.config import SpeculativeConfig


class Proposer(Protocol):
    """Drafts the next tokens of a request from the tokens it has so far.

    One proposer serves the whole engine; what it keeps about a request is keyed by its id and
    dropped by :meth:`on_request_finished`. Calls for one request come in step order; a
    proposer never sees unverified tokens (the scheduler passes only accepted ones).
    """

    def propose(self, req_id: str, token_ids: np.ndarray, max_num_tokens: int) -> np.ndarray:
        """Draft tokens to follow ``token_ids``.

        Args:
            req_id: the request.
            token_ids: ``[num_tokens]`` int32 or int64: the request's verified prompt + output
                tokens, in order (each call's array extends the previous call's).
            max_num_tokens: most drafts wanted (>= 0): the scheduler's cap, at most
                ``num_speculative_tokens`` and the room left by ``max_model_len`` and
                ``max_tokens``.

        Returns:
            ``[0..max_num_tokens]`` int64 draft token ids (empty: nothing worth drafting).
        """
        ...

    def on_request_finished(self, req_id: str, prompt_len: int, token_ids: np.ndarray) -> None:
        """Forget the request (finished, aborted or preempted for good); ``token_ids``
        (``[num_tokens]``, prompt then output; the first ``prompt_len`` are the prompt) may feed
        what the proposer learns across requests. Unknown ids are ignored."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of ``config.method`` ("ngram" or "suffix")."""
    if config.method == "ngram":
        from pagedkv.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config)
    from pagedkv.engine.spec_decode.suffix import SuffixDecodingProposer

    return SuffixDecodingProposer(config)
