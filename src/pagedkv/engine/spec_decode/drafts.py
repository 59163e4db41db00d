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
without them before anything is preempted. A step that carries drafts keeps within the model's
row-exact size (:meth:`SpecDecodeDrafts.set_max_step_tokens`, from the workers'
``max_row_exact_tokens``: the largest step whose rows get their one-token decode steps' bits),
so a verification row computes what the decode step it replaces would and greedy tokens do not
change with speculation: the room left (running prompt chunks' rows counted) is shared among
the unseeded requests, a seeded one drafts nothing then, and a step that waiting requests may
join carries no drafts (their prompt rows are scheduled after the drafts).
Idea and names from vLLM V1 (``Request.spec_token_ids``, ``scheduled_spec_decode_tokens``,
``SpecDecodingStats``).

**Structured outputs.** A request with a grammar drafts the longest prefix of its proposal that
the grammar allows (its matcher accepts the drafts one by one and rolls back: a draft the
grammar refuses ends the drafts). The engine then gives it ``k + 1`` bitmask rows, the mask
after its verified tokens and after each draft, and the worker masks each verification row with
its own before the rejection sampler (greedy: the argmax of the masked row), so it samples what
it would without speculation; the accepted drafts and the sampled token then advance the
matcher in order, as a sampled token does (vLLM V1's ``StructuredOutputManager`` with spec
tokens; :mod:`pagedkv.engine.structured_output`).

**Adaptive draft length.** A draft costs a row of the forward pass whether it is accepted or
not, so where drafts miss (open chat) speculation would make decoding slower. Each request keeps
an estimate ``a`` of the chance that a draft token is accepted (decayed counts of accepted and
tried drafts, starting at 1 in 2), so k drafts are worth ``E(k) = (1 - a^(k+1)) / (1 - a)``
tokens, and what a step of ``T`` tokens costs is measured on this machine
(:class:`~pagedkv.engine.spec_decode.step_costs.StepCosts`: the engine's own decode-step times
per number of tokens, the median of the last few; no table from another CPU). The scheduler
takes the step's decoding requests in order; with ``S`` the tokens the step is expected to yield
so far and ``T`` its rows (both start at the number of running requests: a token and a row
each), a request schedules the ``k`` of its proposal that gives the step the most expected
tokens per second, ``(S - 1 + E(k)) / cost(T + k)`` (:func:`best_num_drafts`), and adds its
``E(k) - 1`` and ``k`` to them. Alone that is ``E(k) / cost(1 + k)``; in a batch a draft row
pays only where the step's marginal row is cheap against what it brings. Where that is ``k = 0``
nothing is scheduled: the step is the plain decode step (no draft rows, the runner's plain
sampler); the workers still propose and the first draft is checked against the token the step
samples, so the estimate recovers when the text starts to repeat. A proposal costs the workers
tens of microseconds a request (a suffix search: milliseconds a step at batch 16), so after
:data:`IDLE_STEPS_BEFORE_PAUSE` decode steps in a row without drafts they propose for the
request only one step in :data:`PROPOSE_EVERY` (:meth:`SpecDecodeDrafts.take_paused`), until
one of those drafts would have been accepted or it schedules drafts again. A seeded request's
draws follow its drafts, so its k must not depend on timing or on the batch: it takes a fixed
cost (:data:`SEEDED_ROW_COST` a row) as if alone, and is never paused (but drafts nothing where
the steps that carry drafts are bounded, :meth:`SpecDecodeDrafts.set_max_step_tokens`). Idea:
SmartSpec's goodput (expected accepted tokens per unit of the batch's step time; Liu et al.,
2024), chosen per request as the acceptance-aware draft lengths of SuffixDecoding and
EAGLE-2-style dynamic drafting are.
"""

from __future__ import annotations

from collections.abc import Collection

from pagedkv.engine.request import Request
from pagedkv.engine.spec_decode.step_costs import StepCosts
from pagedkv.engine.stats import SpecDecodingStats
from pagedkv.errors import ConfigError
from pagedkv.worker.spec_decode.eligibility import may_draft

#: What a draft row costs a seeded request, as a fraction of a one-token step (fixed: its draws
#: follow its drafts, so their number must not depend on timing): about what a row of the 135M
#: default model cost on the AVX2 EPYC first measured (0.16); on the Zen 4 of docs/engine.md a
#: row costs about a third of a step, so there a seeded request drafts somewhat more than pays.
SEEDED_ROW_COST = 0.15

#: How much more a draft count must yield per unit of cost than the step without drafts (and a
#: larger count than a smaller one) to be chosen: estimates that tie within it (rows that cost
#: what they bring) draft nothing, so speculation never costs a user by a rounding.
MIN_GAIN = 1.02

#: Weight of the past in a request's acceptance estimate (each observation decays the counts).
ACCEPTANCE_DECAY = 0.8

#: A request that scheduled no drafts in this many decode steps in a row has the workers
#: propose for it only every :data:`PROPOSE_EVERY` steps (their proposal is work on every step
#: that brings nothing while the rule declines it: open chat); one step with drafts, or a first
#: draft that would have been accepted, ends it.
IDLE_STEPS_BEFORE_PAUSE = 4
#: While paused, the workers propose for the request after one step in this many (the first
#: draft is still checked against the token sampled: a hit ends the pause, so text that starts
#: to repeat is proposed for every step again at most this many steps late).
PROPOSE_EVERY = 4


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens a verification step with ``num_drafts`` drafts is expected to yield when each
    draft is accepted with chance ``acceptance`` (until the first miss) and one token follows:
    ``(1 - a^(k+1)) / (1 - a)``, ``k + 1`` at ``a = 1``."""
    if acceptance >= 1.0:
        return num_drafts + 1.0
    return (1.0 - acceptance ** (num_drafts + 1)) / (1.0 - acceptance)


def best_num_drafts(
    acceptance: float,
    max_num_drafts: int,
    costs: StepCosts,
    step_tokens: int = 1,
    step_expected: float = 1.0,
) -> int:
    """The draft count ``k <= max_num_drafts`` that gives a step the most expected tokens per
    unit of cost (see the module's docstring); 0: none pays.

    Args:
        acceptance: the request's estimated chance that a draft token is accepted, in [0, 1].
        max_num_drafts: the most drafts it may schedule (its proposal, budget and limits).
        costs: the step cost estimate (:meth:`StepCosts.cost` of a number of tokens).
        step_tokens: ``T``, the step's rows so far counting this request's one token (and
            one for each decoding request not yet scheduled); >= 1.
        step_expected: ``S``, the tokens the step is expected to yield so far, counted the
            same way.

    Returns:
        k: a larger k is taken only where it beats the best smaller one by more than
        :data:`MIN_GAIN`; 0 when no k > 0 beats the step without drafts, ``S / cost(T)``, by
        that much.
    """
    cost = costs.cost
    expected, power = 1.0, 1.0
    others = step_expected - 1.0
    best, best_value = 0, step_expected / cost(step_tokens)
    for k in range(1, max_num_drafts + 1):
        power *= acceptance
        expected += power
        value = (others + expected) / cost(step_tokens + k)
        if value > best_value * MIN_GAIN:
            best, best_value = k, value
    return best


class SpecDecodeDrafts:
    """Schedules the workers' draft tokens of the scheduler's decoding requests and rolls back
    the rejected ones.

    Reads the scheduler's max_model_len and its running list's length; owns the drafts
    received and the counters.

    Args:
        max_model_len: most tokens of one request (no draft goes past it).
        running: the scheduler's running requests (read for the batch size, and under a bound
            for their prompt chunks:
            :attr:`RequestQueues.running <pagedkv.engine.request_queues.RequestQueues>`).
        num_speculative_tokens: most drafts per request and step (>= 1).
        num_lookahead_tokens: KV slots past a sampling request's scheduled tokens for the
            workers' draft model to draft into; 0: its method needs none (n-gram, suffix).
        max_num_batched_tokens: the largest step (the step costs measured up to it).
    """

    __slots__ = (
        "_acceptance",
        "_admitting",
        "_drafts",
        "_finished_token_ids",
        "_idle_steps",
        "_max_model_len",
        "_max_num_batched_tokens",
        "_max_step_tokens",
        "_num_decoding",
        "_num_drafts",
        "_num_seen",
        "_paused",
        "_prompt_rows",
        "_room_paused",
        "_running",
        "_seeded_costs",
        "_step_expected",
        "_step_tokens",
        "_timed_num_tokens",
        "_was_room_paused",
        "adaptive",
        "num_lookahead_tokens",
        "num_speculative_tokens",
        "stats",
        "step_costs",
    )

    def __init__(
        self,
        max_model_len: int,
        running: Collection[Request],
        num_speculative_tokens: int,
        num_lookahead_tokens: int = 0,
        max_num_batched_tokens: int = 8192,
    ) -> None:
        self._max_model_len = max_model_len
        self._max_num_batched_tokens = max_num_batched_tokens
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
        #: The most tokens a step with drafts may have, or None (:meth:`set_max_step_tokens`).
        self._max_step_tokens: int | None = None
        #: What a decode-only step costs per number of tokens, learned from the engine's step
        #: times (:meth:`observe_step_time`); replaceable (tests and replays script it).
        self.step_costs = StepCosts(max_num_batched_tokens)
        #: The fixed costs of a seeded request's rule (its draft count must not depend on timing).
        self._seeded_costs = StepCosts(
            max_num_batched_tokens, prior_row_cost=SEEDED_ROW_COST, learn=False
        )
        #: This step so far: its rows and expected tokens (the rule's T and S), the requests that
        #: decode in it and their drafts; the last step's tokens when it was decode-only (0: not
        #: timed).
        self._step_tokens = 1
        self._step_expected = 1.0
        self._num_decoding = 0
        self._num_drafts = 0
        self._timed_num_tokens = 0
        #: This step: the running requests :meth:`propose` was called for so far, and under
        #: a bound the rows of every running request's prompt chunk past the one each counts
        #: in ``_step_tokens`` (:meth:`begin_step`).
        self._num_seen = 0
        self._prompt_rows = 0
        #: whether waiting requests may join this step (:meth:`begin_step`)
        self._admitting = False
        #: the requests whose proposer this step (and the last) paused for want of room under
        #: the bound: their next step without drafts does not count as idle.
        self._room_paused: set[str] = set()
        self._was_room_paused: set[str] = set()
        #: request id -> [accepted, tried, shadow draft or -1]: decayed counts of its draft
        #: tokens, and the first draft it did not schedule (checked against the next token).
        self._acceptance: dict[str, list[float]] = {}
        #: request id -> the workers' drafts after its last sampled token (not yet used).
        self._drafts: dict[str, list[int]] = {}
        #: request id -> the tokens a finished request got that the workers do not hold
        #: (``SchedulerOutput.finished_token_ids`` of the next step).
        self._finished_token_ids: dict[str, list[int]] = {}
        #: request id -> decode steps in a row it scheduled no drafts (token proposers only).
        self._idle_steps: dict[str, int] = {}
        #: this step's requests the workers propose nothing for after it
        #: (``SchedulerOutput.draft_paused_req_ids``).
        self._paused: set[str] = set()

    @property
    def max_step_tokens(self) -> int | None:
        """The most tokens a step that carries drafts may have (None: no bound); see
        :meth:`set_max_step_tokens`."""
        return self._max_step_tokens

    def set_max_step_tokens(self, max_step_tokens: int | None) -> None:
        """Keep the steps that carry drafts within ``max_step_tokens`` tokens: the model's
        largest step whose rows get their one-token decode steps' bits (the engine sets it
        from the workers' ``max_row_exact_tokens``), so that a verification step computes what
        the decode steps it replaces would and greedy tokens do not change with speculation.
        :meth:`propose` then gives the step's room (the bound less a row for every running
        request, the drafts already scheduled and the running prompt chunks' rows) to the
        unseeded requests in equal shares, at most ``ceil(room / requests left)`` each, no
        drafts to a seeded request (its draft count, which its draws follow, must not depend
        on the batch), and none at all in a step that waiting requests may join
        (:meth:`begin_step`). None: no bound.

        Raises:
            ConfigError: not None and not an int >= 1 (nothing changed).
        """
        if max_step_tokens is not None and (
            isinstance(max_step_tokens, bool)
            or not isinstance(max_step_tokens, int)
            or max_step_tokens < 1
        ):
            raise ConfigError(
                f"max_step_tokens must be None or an int >= 1, got {max_step_tokens!r}"
            )
        self._max_step_tokens = max_step_tokens

    def begin_step(self, may_admit: bool = False) -> None:
        """Start a schedule: every running request counts a row and a token of the step (the
        rule's ``T`` and ``S``) until its own drafts are chosen. ``may_admit``: waiting
        requests may join the step after the running ones (their prompt rows would take a
        bounded step past :meth:`set_max_step_tokens`, so under a bound it carries no
        drafts). Under a bound the running requests' prompt chunks are counted here, whatever
        their place in the running order (what is left of each, at most the step's token
        budget: never too few)."""
        self._admitting = may_admit
        running = self._running
        num_running = max(len(running), 1)
        self._step_tokens = num_running
        self._step_expected = float(num_running)
        self._num_decoding = 0
        self._num_drafts = 0
        self._num_seen = 0
        self._prompt_rows = 0
        if self._max_step_tokens is not None:  # rows past the one each request counts
            budget = self._max_num_batched_tokens
            for request in running:
                left = min(request.num_tokens - request.num_computed_tokens, budget)
                self._prompt_rows += max(left - 1, 0)
        self._paused = set()
        self._was_room_paused, self._room_paused = self._room_paused, set()

    def take_paused(self) -> set[str]:
        """The step's requests whose drafts the workers need not propose after it
        (``SchedulerOutput.draft_paused_req_ids``): those that scheduled no drafts in their
        last :data:`IDLE_STEPS_BEFORE_PAUSE` decode steps, but one step in
        :data:`PROPOSE_EVERY`; a first draft that would have been accepted (checked against
        the token sampled) ends the pause. Only for the adaptive rule, proposers of token ids
        (a draft model's proposal also writes its KV, so it always runs) and unseeded requests
        (a seeded request's drafts, hence its draws, must not depend on the batch). Also, for
        proposers of token ids, those that had no row to spare under
        :meth:`set_max_step_tokens` (every seeded request then: it drafts nothing)."""
        paused, self._paused = self._paused, set()
        return paused

    def scheduled(self, num_requests: int, num_scheduled_tokens: int) -> None:
        """The schedule is made (``num_requests`` requests, ``num_scheduled_tokens`` in all):
        its size is timed (:meth:`observe_step_time`) when every request in it decodes (one new
        token and its drafts, as counted by :meth:`propose` and :meth:`drop`), else not (a
        prompt chunk, or a request preempted after its drafts were counted)."""
        decode_only = (
            num_requests > 0
            and self._num_decoding == num_requests
            and num_scheduled_tokens == num_requests + self._num_drafts
        )
        self._timed_num_tokens = num_scheduled_tokens if decode_only else 0

    def observe_step_time(self, seconds: float) -> None:
        """The last scheduled step took ``seconds`` (wall, schedule to outputs): learned as the
        cost of its number of tokens when it was decode-only (:meth:`scheduled`)."""
        if self._timed_num_tokens:
            self.step_costs.observe(self._timed_num_tokens, seconds)
            self._timed_num_tokens = 0

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
        self._num_seen += 1
        if num_tokens - request.num_computed_tokens != 1:
            request.spec_token_ids = []
            return 0
        limit = min(
            self.num_speculative_tokens,
            token_budget,
            self._max_model_len - num_tokens - 1,
            params.max_tokens - request.num_output_tokens - 1,
        )
        self._num_decoding += 1
        if limit <= 0 or not may_draft(params, request.num_output_tokens, request.pooling_params):
            request.spec_token_ids = []
            return 0
        drafts = self._drafts.pop(request.request_id, [])[:limit]
        if request.structured_output is not None:  # what its grammar allows
            drafts = request.structured_output.validate_tokens(request.output_token_ids, drafts)
        if state is None:
            state = self._acceptance[request.request_id] = [1.0, 2.0, -1]
        k = len(drafts)
        no_room = held = False
        if self._max_step_tokens is not None:
            # rows past the model's row-exact size would take other products (other bits)
            if params.seed is not None:  # its count must not depend on the batch: none
                k, no_room = 0, True
            elif self._admitting:  # prompts may join this step: none in it
                k, held = 0, True
            else:
                room = self._max_step_tokens - self._step_tokens - self._prompt_rows
                left = max(len(self._running) - self._num_seen + 1, 1)  # this one included
                share = -(-room // left) if room > 0 else 0
                k, no_room = min(k, share), share == 0
        acceptance = state[0] / state[1]
        if k and self.adaptive:
            if params.seed is not None:
                # A seeded request's draws follow its drafts: their number must depend neither
                # on the batch nor on timing, so that it samples the same tokens every time.
                k = best_num_drafts(acceptance, k, self._seeded_costs)
            else:
                k = best_num_drafts(
                    acceptance, k, self.step_costs, self._step_tokens, self._step_expected
                )
        if k:  # the step's rows and expected tokens for the requests after it
            self._num_drafts += k
            self._step_tokens += k
            self._step_expected += expected_tokens(acceptance, k) - 1.0
        state[2] = drafts[0] if drafts and not k else -1
        request.spec_token_ids = drafts[:k]
        request_id = request.request_id
        if no_room or held:  # no row to spare: not idle; a token proposer need not propose
            self._room_paused.add(request_id)
            if not self.num_lookahead_tokens:
                self._paused.add(request_id)
        elif not drafts and request_id in self._was_room_paused:
            pass  # its proposer skipped the last step for want of room: not idle either
        elif self.adaptive and not self.num_lookahead_tokens and params.seed is None:
            self._count_idle(request_id, k)
        return k

    def _count_idle(self, request_id: str, num_drafts: int) -> None:
        """Count a decode step of ``request_id`` with ``num_drafts`` drafts scheduled, and
        pause its proposals after it where it has drafted nothing for a while
        (:meth:`take_paused`)."""
        if num_drafts:
            self._idle_steps.pop(request_id, None)
            return
        idle = self._idle_steps.get(request_id, 0) + 1
        self._idle_steps[request_id] = idle
        if idle >= IDLE_STEPS_BEFORE_PAUSE and idle % PROPOSE_EVERY:
            self._paused.add(request_id)

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

    def drop(self, request: Request) -> int:
        """Take ``request``'s drafts away (their blocks do not fit), and their rows out of the
        step's count (the rule's T and S); returns how many. (A request preempted after its
        drafts were counted stays counted: the rule then sees the step a little larger; such
        a step is not decode-only, so its time is not learned.)"""
        num_drafts = len(request.spec_token_ids)
        request.spec_token_ids = []
        state = self._acceptance.get(request.request_id)
        self._num_drafts -= num_drafts
        if num_drafts and state is not None:
            self._step_tokens -= num_drafts
            self._step_expected -= expected_tokens(state[0] / state[1], num_drafts) - 1.0
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
                hit = state[2] == token_id
                state[0] = ACCEPTANCE_DECAY * state[0] + hit
                state[1] = ACCEPTANCE_DECAY * state[1] + 1
                state[2] = -1
                if hit:  # the text may repeat from here: propose every step again
                    self._idle_steps.pop(request.request_id, None)
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
        self._idle_steps.pop(request_id, None)
        num_sent = request.num_sent_tokens
        if num_sent and len(request.all_token_ids) > num_sent:
            self._finished_token_ids[request_id] = request.all_token_ids[num_sent:]


__all__ = [
    "ACCEPTANCE_DECAY",
    "IDLE_STEPS_BEFORE_PAUSE",
    "MIN_GAIN",
    "PROPOSE_EVERY",
    "SEEDED_ROW_COST",
    "SpecDecodeDrafts",
    "best_num_drafts",
    "expected_tokens",
]
