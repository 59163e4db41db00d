"""The interface the scheduler calls to draft tokens for a request (vLLM V1's proposers)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagedkv.config import SpeculativeConfig
from pagedkv.engine.spec_decode.ngram import NgramProposer
from pagedkv.engine.spec_decode.suffix import SuffixDecodingProposer


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
        return NgramProposer(config)
    return SuffixDecodingProposer(config)


class BufferedProposer:
    """A proposer fed with the scheduler's token lists: each drafting request's verified tokens
    are kept as an int32 array that grows by its new tokens only (O(new tokens) a step, not a
    list-to-array copy of the whole context), and the proposer reads a view of it. The
    scheduler's :class:`~pagedkv.engine.spec_decode.drafts.SpecDecodeDrafts` calls it; being
    built by the engine and handed over, it keeps numpy out of the scheduler's imports.

    Args:
        proposer: the proposer (:func:`make_proposer`); replaceable (tests script one).
        max_model_len: most tokens of a request (each buffer's size).
    """

    __slots__ = ("_buffers", "max_model_len", "proposer")

    def __init__(self, proposer: Proposer, max_model_len: int) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._buffers: dict[str, tuple[np.ndarray, list[int]]] = {}

    def propose(self, req_id: str, token_ids: list[int], max_num_tokens: int) -> list[int]:
        """At most ``max_num_tokens`` drafts to follow ``token_ids`` (the request's verified
        tokens, each call's list extending the previous call's, or shorter: a new buffer)."""
        num_tokens = len(token_ids)
        entry = self._buffers.get(req_id)
        if entry is None or entry[1][0] > num_tokens:
            entry = (np.empty(self.max_model_len, dtype=np.int32), [0])
            self._buffers[req_id] = entry
        buffer, filled = entry
        if filled[0] < num_tokens:
            buffer[filled[0] : num_tokens] = token_ids[filled[0] :]
            filled[0] = num_tokens
        drafts = self.proposer.propose(req_id, buffer[:num_tokens], max_num_tokens)
        return drafts[:max_num_tokens].tolist()

    def receive(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Nothing: n-gram and suffix draft in the scheduler."""

    def finished(self, req_id: str, prompt_len: int, token_ids: list[int]) -> None:
        """Forget ``req_id``; its tokens (``prompt_len`` of them the prompt) go to the proposer,
        which may learn from them (SuffixDecoding's tree of earlier outputs)."""
        self._buffers.pop(req_id, None)
        self.proposer.on_request_finished(req_id, prompt_len, np.asarray(token_ids, np.int32))
