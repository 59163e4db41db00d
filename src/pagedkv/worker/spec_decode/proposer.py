"""The one interface of speculative decoding's drafters (vLLM V1's proposers in the model runner),
its plain-data input, and the proposers of token ids (n-gram, suffix).

After each step the model runner collects the requests that sampled and may draft
(:func:`~pagedkv.worker.spec_decode.eligibility.may_draft`) into a :class:`DraftRequests` and
asks its :class:`DraftProposer` for their next drafts::

    step N:   scheduled  [ t  d1 d2 d3 ]     verified: d1 accepted, x sampled
    runner:   tokens  = prompt + output + d1 x    (the persistent batch's row, x written after)
              drafts  = proposer.propose_drafts(...)   -> ModelRunnerOutput.draft_token_ids
    step N+1: the scheduler schedules k <= len(drafts) of them (its adaptive rule, the grammar,
              the token budget): [ x  y1 .. yk ]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pagedkv.worker.input_batch import ModelInputs


@dataclass(slots=True)
class DraftRequests:
    """The requests to draft for after a step, as plain data (``n`` of them).

    Attributes:
        req_ids: their ids.
        rows: ``[n]`` int64, their rows in the runner's persistent batch (block tables).
        token_ids: per request a ``[num_tokens]`` int32 array (a view of its row: do not keep
            it past the call): its prompt and verified output, the step's accepted drafts and
            sampled token included; the drafts follow its last token.
        max_num_drafts: ``[n]`` int64 (>= 1), most drafts each: ``num_speculative_tokens``,
            less where ``max_model_len`` or its ``max_tokens`` leaves less room (the step
            after the drafts adds a token of its own).
        num_lookahead_tokens: ``[n]`` int64, the KV slots past its scheduled tokens the
            scheduler allocated (``SchedulerOutput.num_lookahead_tokens``): a proposer that
            writes KV of its own (the draft model) drafts at most this many.
    """

    req_ids: list[str]
    rows: np.ndarray
    token_ids: list[np.ndarray]
    max_num_drafts: np.ndarray
    num_lookahead_tokens: np.ndarray


class DraftProposer(Protocol):
    """Drafts the next tokens of requests (n-gram, suffix, draft model). One proposer serves the
    runner; what it keeps about a request is keyed by its id and dropped by :meth:`finished`."""

    def forward(self, inputs: ModelInputs) -> None:
        """See the step's tokens before the target model runs them (``inputs``: the step's
        inputs): the draft model writes its KV of them; proposers of token ids do nothing."""
        ...

    def propose_drafts(self, requests: DraftRequests) -> list[list[int]]:
        """Per request of ``requests``, in order, its drafts (at most its
        ``max_num_drafts``; [] when nothing is worth drafting)."""
        ...

    def finished(self, req_id: str, prompt_len: int, token_ids: np.ndarray) -> None:
        """Forget ``req_id`` (finished or aborted); ``token_ids`` (``[num_tokens]`` int32, its
        final prompt then output; the first ``prompt_len`` are the prompt) may teach the
        proposer (SuffixDecoding's tree of earlier outputs). Unknown ids are ignored."""
        ...


class TokenProposer:
    """A :class:`DraftProposer` that drafts from each request's token ids alone (n-gram,
    suffix): :meth:`propose` per request."""

    def forward(self, inputs: ModelInputs) -> None:
        """Nothing: no model of its own."""

    def propose_drafts(self, requests: DraftRequests) -> list[list[int]]:
        """:meth:`propose` of each request."""
        return [
            self.propose(req_id, token_ids, max_num_drafts)[:max_num_drafts].tolist()
            for req_id, token_ids, max_num_drafts in zip(
                requests.req_ids, requests.token_ids, requests.max_num_drafts.tolist(), strict=True
            )
        ]

    def propose(self, req_id: str, token_ids: np.ndarray, max_num_tokens: int) -> np.ndarray:
        """Draft tokens to follow ``token_ids``.

        Args:
            req_id: the request.
            token_ids: ``[num_tokens]`` int32 or int64: the request's verified prompt + output
                tokens, in order (each call's array extends the previous call's).
            max_num_tokens: most drafts wanted (>= 0).

        Returns:
            ``[0..max_num_tokens]`` int64 draft token ids (empty: nothing worth drafting).
        """
        raise NotImplementedError

    def finished(self, req_id: str, prompt_len: int, token_ids: np.ndarray) -> None:
        """Nothing to forget (override to learn from finished requests)."""
