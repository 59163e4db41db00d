"""The scheduler's draft tokens (speculative decoding): how many, their slots and the rollback.

The drafts are made in the workers (:mod:`pagedkv.worker.spec_decode`, every method: n-gram,
suffix, draft model): after each step the model runner proposes up to
``num_speculative_tokens`` drafts for every request that sampled and may draft and returns them
in ``ModelRunnerOutput.draft_token_ids`` (vLLM V1's drafters in the model runner). This keeps
them (:meth:`SpecDecodeDrafts.receive`) until the request's next step; a decoding request that
has caught up (one token to compute) schedules up to all of them after its last token within
the step's token budget (vLLM V1's accounting: a draft costs a token of
``max_num_batched_tokens``), with KV slots from the same ``allocate_slots`` call::

    before the step   | verified tokens (num_tokens) ......... t | d1 d2 d3 |   k = 3 drafts
    scheduled                                               [ t   d1 d2 d3 ]  1 + k tokens
    num_computed after schedule():  num_tokens + k
    the workers accept j = 1 of them and sample one more token x:
    after the step    | verified ............. t d1 x |           num_tokens + j + 1 tokens
    num_computed:     num_tokens + j   (k - j rejected: rolled back; the slots past it are
                                        written again by the next step)

A request's drafts follow its tokens when they were proposed; its tokens change only when it
samples, and then its drafts are replaced (or dropped), so drafts kept over a step it was not
scheduled in still follow them. The drafts are never in the request's token ids until accepted,
so they are never hashed: no unverified token enters the prefix cache, the KV tier or the KV
events (the KV cache manager caches at most ``len(all_token_ids)`` tokens). Whether a request
may draft is one rule for both sides (:func:`~pagedkv.worker.spec_decode.eligibility.may_draft`:
no penalties, ``min_tokens`` reached, no logprobs, so no beam search); a request that may not
decodes exactly as without speculation. When the drafts' blocks do not fit, the request runs
without them before anything is preempted. Idea and names from vLLM V1
(``Request.spec_token_ids``, ``scheduled_spec_decode_tokens``, ``SpecDecodingStats``).

**Structured outputs.** A request with a grammar drafts the longest prefix of its proposal that
the grammar allows (its matcher accepts the drafts one by one and rolls back: a draft the
grammar refuses ends the drafts). The engine then gives it ``k + 1`` bitmask rows, the mask
after its verified tokens and after each draft, and the worker masks each verification row with
its own before the rejection sampler (greedy: the argmax of the masked row), so it samples what
it would without speculation; the accepted drafts and the sampled token then advance the
matcher in order, as a sampled token does (vLLM V1's ``StructuredOutputManager`` with spec
tokens; :mod:`pagedkv.engine.structured_output`).

**Adaptive draft length.** A draft costs a row of the forward pass whether it is accepted or
not, so where drafts miss (open chat) speculation would make decoding slower. Each request
keeps an estimate ``a`` of the chance that a draft token is accepted (decayed counts of
accepted and tried drafts, starting at 1 in 2) and schedules the ``k`` of its proposal that
gives the most expected tokens, ``(1 - a^(k+1)) / (1 - a)``, per cost of its step
(:func:`best_num_drafts`). Alone, that cost is the measured step cost with k drafts
(:data:`STEP_COST`: not linear in k, and ending at k = 7, past which a step leaves the 4-bit
kernels); in a batch, a share of the step plus ``DRAFT_TOKEN_COST`` per draft. Where that is
``k = 0`` nothing is scheduled: the step is the plain decode step (no draft rows, the runner's
plain sampler); the workers still propose (microseconds beside a step of tens of
milliseconds) and the first draft is checked against the token the step samples, so the
estimate recovers when the text starts to repeat. Idea: the acceptance-aware draft lengths of
SuffixDecoding and of EAGLE-2-style dynamic drafting, as a per-request rule.
"""

from __future__ import annotations

from collections.abc import Sized

from pagedkv.engine.request import Request
from pagedkv.engine.stats import SpecDecodingStats
from pagedkv.worker.spec_decode.eligibility import may_draft

#: What a decode step of one request with k drafts costs, k = 0, 1, ..., 7, in one-token steps
#: (the batch-1 cost table of :func:`best_num_drafts`): SmolLM2-135M Q4_1 on a 2-core AMD EPYC
#: (AVX2), the median CPU time of the benchmark's decode steps with k drafts over that of steps
#: without (``benchmarks/bench_spec_decode.py --step-times``, open chat and grounded work,
#: pagedkv's own 4-bit kernels; k = 5, 6 with torch's kernels): docs/engine.md, "Adaptive draft
#: length". Not linear in k. Ends at k = 7: a step of 9 or more tokens leaves the 4-bit
#: kernels for dense fp32 products (~2.4x a one-token step).
STEP_COST = (1.0, 1.16, 1.30, 1.45, 1.61, 1.90, 2.10, 2.22)

#: What a draft token costs in a batch of several decoding requests, as a fraction of a
#: one-token step (a row through every layer and the LM head, and its verification).
DRAFT_TOKEN_COST = 0.2

#: Weight of the past in a request's acceptance estimate (each observation decays the counts).
ACCEPTANCE_DECAY = 0.8


def best_num_drafts(acceptance: float, max_num_drafts: int, num_running: int = 1) -> int:
    """The draft count ``k <= max_num_drafts`` with the most expected tokens per cost for a
    per-token acceptance probability ``acceptance`` (see the module's docstring) in a batch of
    ``num_running`` decoding requests; 0: none pays.

    Alone (``num_running == 1``) a step with k drafts costs ``STEP_COST[k]`` one-token steps
    and k never exceeds its last entry: k = 1 pays from ``a`` of 0.16, and the most (7) from
    0.89. In a batch, a request's share of a step is ``(1 + (n - 1) c) / n`` one-token steps
    (each other request's row costs ``c = DRAFT_TOKEN_COST`` more), and each of its drafts
    costs ``c`` on top: in a batch of 16 a draft pays from about 0.8 (the step is already busy,
    so a row that is thrown away costs more of the request's share). At batch 16 the
    benchmark's open chat (acceptance about 0.7) ran at 0.88x of no speculation when it drafted
    and its grounded work (about 0.9) gained: the rule drafts for the second only."""
    expected, power = 1.0, 1.0
    best, best_value = 0, 1.0
    if num_running == 1:
        for k in range(1, min(max_num_drafts, len(STEP_COST) - 1) + 1):
            power *= acceptance
            expected += power
            value = expected / STEP_COST[k]
            if value > best_value:
                best, best_value = k, value
        return best
    cost = DRAFT_TOKEN_COST
    share = (1 + (num_running - 1) * cost) / num_running
    best_value = 1.0 / share
    for k in range(1, max_num_drafts + 1):
        power *= acceptance
        expected += power
        value = expected / (share + cost * k)
        if value > best_value:
            best, best_value = k, value
    return best


class SpecDecodeDrafts:
    """Schedules the workers' draft tokens of the scheduler's decoding requests and rolls back
    the rejected ones.

    Reads the scheduler's max_model_len and its running list's length; owns the drafts
    received and the counters.

    Args:
        max_model_len: most tokens of one request (no draft goes past it).
        running: the scheduler's running requests (read for the batch size:
            :attr:`RequestQueues.running <pagedkv.engine.request_queues.RequestQueues>`).
        num_speculative_tokens: most drafts per request and step (>= 1).
        num_lookahead_tokens: KV slots past a sampling request's scheduled tokens for the
            workers' draft model to draft into; 0: its method needs none (n-gram, suffix).
    """

    __slots__ = (
        "_acceptance",
        "_drafts",
        "_finished_token_ids",
        "_max_model_len",
        "_running",
        "adaptive",
        "num_lookahead_tokens",
        "num_speculative_tokens",
        "stats",
    )

    def __init__(
        self,
        max_model_len: int,
        running: Sized,
        num_speculative_tokens: int,
        num_lookahead_tokens: int = 0,
    ) -> None:
        self._max_model_len = max_model_len
        self._running = running
        self.num_speculative_tokens = num_speculative_tokens
        #: KV slots past a sampling request's scheduled tokens for the workers' draft model
        #: (its drafts' KV); 0: the method writes no KV of its own (n-gram, suffix).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * num_speculative_tokens,
            num_drafts_per_len=[0] * num_speculative_tokens,
        )
        #: False: every proposed draft is scheduled (the adaptive length is off; benchmarks).
        self.adaptive = True
        #: request id -> [accepted, tried, shadow draft or -1]: decayed counts of its draft
        #: tokens, and the first draft it did not schedule (checked against the next token).
        self._acceptance: dict[str, list[float]] = {}
        #: request id -> the workers' drafts after its last sampled token (not yet used).
        self._drafts: dict[str, list[int]] = {}
        #: request id -> the tokens a finished request got that the workers do not hold
        #: (``SchedulerOutput.finished_token_ids`` of the next step).
        self._finished_token_ids: dict[str, list[int]] = {}

    def propose(self, request: Request, token_budget: int) -> int:
        """Set ``request.spec_token_ids`` to the workers' drafts (:meth:`receive`) when it
        decodes (one token to compute), as many as pay (:func:`best_num_drafts`) and its
        grammar allows: at most ``token_budget`` of them, never past max_model_len or
        max_tokens (the step adds one token after the accepted drafts). Returns how many (0:
        none, or not decoding)."""
        params = request.sampling_params
        num_tokens = request.num_tokens
        state = self._acceptance.get(request.request_id)
        if state is not None:
            state[2] = -1  # a draft kept from an earlier step is not about this one's token
        if num_tokens - request.num_computed_tokens != 1:
            request.spec_token_ids = []
            return 0
        limit = min(
            self.num_speculative_tokens,
            token_budget,
            self._max_model_len - num_tokens - 1,
            params.max_tokens - request.num_output_tokens - 1,
        )
        if limit <= 0 or not may_draft(params, request.num_output_tokens, request.pooling_params):
            request.spec_token_ids = []
            return 0
        drafts = self._drafts.pop(request.request_id, [])[:limit]
        if request.structured_output is not None:  # what its grammar allows
            drafts = request.structured_output.validate_tokens(request.output_token_ids, drafts)
        if state is None:
            state = self._acceptance[request.request_id] = [1.0, 2.0, -1]
        k = len(drafts)
        if k and self.adaptive:
            # A seeded request's draws follow its drafts: their number must not depend on the
            # batch, so that it samples the same tokens alone or with others.
            num_running = 1 if params.seed is not None else len(self._running)
            k = best_num_drafts(state[0] / state[1], k, num_running)
        state[2] = drafts[0] if drafts and not k else -1
        request.spec_token_ids = drafts[:k]
        return k

    def lookahead(self, request: Request, num_tokens_after: int) -> int:
        """KV slots to allocate past ``request``'s scheduled tokens for the workers' draft
        model to draft into, given ``num_tokens_after`` (its computed tokens after the step,
        drafts included): 0 unless the step samples for it (every token computed) and it may
        draft; never past max_model_len."""
        if (
            not self.num_lookahead_tokens
            or num_tokens_after < request.num_tokens
            or not may_draft(
                request.sampling_params, request.num_output_tokens, request.pooling_params
            )
        ):
            return 0
        room = self._max_model_len - num_tokens_after
        return max(0, min(self.num_lookahead_tokens, room))

    def receive(self, sampling: list[Request], draft_token_ids: dict[str, list[int]]) -> None:
        """Keep the workers' drafts of the last step (``ModelRunnerOutput.draft_token_ids``)
        for each request that sampled in it (``sampling``) and is not finished: they follow
        its new tokens; an earlier step's drafts of such a request no longer do (dropped)."""
        drafts = self._drafts
        for request in sampling:
            request_id = request.request_id
            new = draft_token_ids.get(request_id)
            if new and not request.is_finished:
                drafts[request_id] = new
            else:
                drafts.pop(request_id, None)

    def take_finished_token_ids(self) -> dict[str, list[int]]:
        """The finished requests' tokens the workers do not hold, since the last call
        (``SchedulerOutput.finished_token_ids``)."""
        taken, self._finished_token_ids = self._finished_token_ids, {}
        return taken

    @staticmethod
    def drop(request: Request) -> int:
        """Take ``request``'s drafts away (their blocks do not fit); returns how many."""
        num_drafts = len(request.spec_token_ids)
        request.spec_token_ids = []
        return num_drafts

    def roll_back(
        self, sampling: list[Request], tokens: list[int], num_accepted: dict[str, int]
    ) -> dict[str, list[int]]:
        """:meth:`accepted` for each sampling request with drafts (``num_accepted``: the
        workers' counts, checked); returns request id -> its accepted drafts. A request that
        proposed drafts but scheduled none has its first one checked against its sampled token
        (``tokens``, one per sampling request)."""
        accepted = {}
        acceptance = self._acceptance
        for request, token_id in zip(sampling, tokens, strict=True):
            state = acceptance.get(request.request_id)
            if state is None:
                continue
            if request.spec_token_ids:
                accepted[request.request_id] = self.accepted(
                    request, num_accepted[request.request_id]
                )
            elif state[2] >= 0:  # a draft it did not schedule: would it have been accepted?
                state[0] = ACCEPTANCE_DECAY * state[0] + (state[2] == token_id)
                state[1] = ACCEPTANCE_DECAY * state[1] + 1
                state[2] = -1
        return accepted

    def accepted(self, request: Request, num_accepted: int) -> list[int]:
        """Roll ``request`` back to its accepted drafts (call before appending its tokens): its
        ``num_computed_tokens`` drops by the rejected count; returns the accepted drafts
        (the first ``num_accepted``), which precede the step's sampled token. Counts them.

        ``num_accepted`` is checked by
        :func:`~pagedkv.engine.sampled_tokens.match_sampled_tokens` first.
        """
        drafts = request.spec_token_ids
        num_drafts = len(drafts)
        request.reject_draft_tokens(num_drafts - num_accepted)
        request.spec_token_ids = []
        state = self._acceptance[request.request_id]  # tried: the accepted and the first miss
        state[0] = ACCEPTANCE_DECAY * state[0] + num_accepted
        state[1] = ACCEPTANCE_DECAY * state[1] + num_accepted + (num_accepted < num_drafts)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        stats.num_drafts_per_len[num_drafts - 1] += 1
        per_pos = stats.num_accepted_tokens_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1
        return drafts[:num_accepted]

    def finished(self, request: Request) -> None:
        """Forget a finished request; the workers get the tokens it got since they last got
        its tokens with the next step (their proposer may learn from its output)."""
        request_id = request.request_id
        self._acceptance.pop(request_id, None)
        self._drafts.pop(request_id, None)
        num_sent = request.num_sent_tokens
        if num_sent and len(request.all_token_ids) > num_sent:
            self._finished_token_ids[request_id] = request.all_token_ids[num_sent:]


__all__ = [
    "ACCEPTANCE_DECAY",
    "DRAFT_TOKEN_COST",
    "STEP_COST",
    "SpecDecodeDrafts",
    "best_num_drafts",
]
