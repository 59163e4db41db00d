"""Continuous-batching scheduler over the paged KV cache (vLLM V1 style: no prefill/decode phases).

Each request has ``num_computed_tokens`` (tokens whose KV is in the cache); every step gives each
scheduled request ``num_scheduled_tokens`` more, within a token budget (max_num_batched_tokens) and
a request cap (max_num_seqs). A prompt longer than the budget is split over several steps (chunked
prefill) and shares steps with other requests' decode tokens::

    step k:  [ req A: 1 decode token | req B: 1 decode token | req C: 254 prompt tokens (chunk) ]
    step k+1:[ req A: 1              | req B: 1              | req C: 146 (rest) -> samples ]

Order within a step: running requests first (allocate_slots; when no block can be had, preempt the
newest running request, or the lowest-priority one under policy="priority": its blocks are freed
and it goes back to the front of the waiting queue, its full blocks still in the prefix cache),
then waiting requests (get_computed_blocks, then allocate_slots) in queue order.

The scheduler coordinates; collaborators that each own one job and its state are called at
named points of the step::

    schedule():  forks.fork_pending()              n > 1 samples fork from their parent
                 _schedule_running(step)           decode tokens, rest of chunked prefills
                   drafts.propose                  how many of the workers' drafts to run
                 _admit_waiting(step)              tier_loads.get_computed_blocks / admitted
                   beams.unpark(step), again       only parked beams left: one search whole
                 build_scheduler_output(step)      what the workers get (and
                                                   queues.take_finished_ids()); num_computed
                                                   advances
                 forks.note_fork_points(step)
    update_from_output():  tier_loads.update       loads done or failed, stores dropped
                           drafts.roll_back        rejected draft tokens' KV given up
                           drafts.receive          the workers' drafts for the next step
                           append_sampled_tokens   tokens appended, stop checks, beam reports
                           queues.release          finished requests' blocks etc. freed
                           beams.step              a beam search's choice

(:mod:`~pagedkv.engine.sample_forks`, :mod:`~pagedkv.engine.kv_tier_loads`,
:mod:`~pagedkv.engine.beam_groups`, :mod:`~pagedkv.engine.scheduled_step`,
:mod:`~pagedkv.engine.sampled_tokens`; requests that can never run:
:mod:`~pagedkv.engine.rejections`; draft tokens: :mod:`~pagedkv.engine.spec_decode.drafts`).

One object owns the requests: :class:`~pagedkv.engine.request_queues.RequestQueues` holds the
running list, the waiting queue, the loading set (KV tier hits), the id map and the ids finished
since the last step, and moves requests between them (admit, preempt, requeue at the front) and
out (``release``: the one path that frees a request's blocks, grammar, drafts and tier loads).
Each collaborator is built with the narrow things it uses (the queues, the KV cache interface,
the counters, a limit or two) and owns only its own state; none holds the scheduler. The engine
asks the scheduler (``get_request``, ``request_states``, ``num_loading``, ``note_finished``),
never its queues.

The scheduler is torch-free and model-independent: anything that turns a :class:`SchedulerOutput`
into a :class:`ModelRunnerOutput` (one sampled token per sampling request) can drive it (the
engine's model runner, or the simulator's fake model). See docs/engine.md for the driving loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

from pagedkv.config import SchedulerConfig, SpeculativeConfig
from pagedkv.core.interface import KVCacheInterface
from pagedkv.engine.beam_groups import BeamSearchGroups
from pagedkv.engine.kv_tier_loads import KVTierLoads
from pagedkv.engine.rejections import Rejections
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_limits import RequestLimits, check_scheduler_options
from pagedkv.engine.request_queues import RequestQueues
from pagedkv.engine.sample_forks import SampleForks
from pagedkv.engine.sampled_tokens import (
    append_sampled_tokens,
    finish_pooled,
    match_sampled_tokens,
)
from pagedkv.engine.scheduled_step import ScheduledStep, build_scheduler_output
from pagedkv.engine.spec_decode.drafts import SpecDecodeDrafts
from pagedkv.engine.stats import SchedulerStats
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.worker.outputs import ModelRunnerOutput
from pagedkv.worker.scheduler_output import SchedulerOutput


class Scheduler:
    """Decides, each step, which requests compute how many tokens, within the KV cache.

    Args:
        kv_cache_manager: the KV cache (its ``block_size``, ``num_blocks`` and specs size the
            checks below).
        max_num_seqs: most requests running at once (>= 1).
        max_num_batched_tokens: token budget of one step (>= 1).
        max_model_len: most tokens (prompt + output) of one request (>= 1).
        enable_chunked_prefill: split prompts longer than the remaining budget over several
            steps; when off, max_num_batched_tokens must be >= max_model_len.
        policy: "fcfs" (arrival order; preempt the newest) or "priority" (lower
            ``Request.priority`` first; preempt the lowest priority, newest among equals).
        admission: what a waiting request that does not fit does to those behind it: "fcfs"
            (they wait too) or "skip" (they are tried in queue order; skipped requests keep
            their place at the front of the queue).
        preemption_mode: "recompute" (vLLM's default: the victim's blocks are freed; its
            cached ones stay hit-able until reused) or "swap" (vLLM V0's word: the victim's
            cached blocks are also paged out to the KV tier at once, so its resumption loads
            them instead of recomputing; needs a tier).
        wait_for_kv_loads: a KV tier hit waits (WAITING_FOR_REMOTE_KVS, the rest of the batch
            runs) until the workers report its loads in ``ModelRunnerOutput.finished_kv_loads``
            / ``failed_kv_loads`` (the engine's, :meth:`from_config`). False: it runs in the
            step that allocates it, for a driver without workers whose loads are instant and
            never fail (the simulator).
        num_speculative_tokens: speculative decoding: decoding requests schedule up to that
            many of the workers' draft tokens a step
            (:mod:`~pagedkv.engine.spec_decode.drafts`); 0: off.
        num_lookahead_tokens: KV slots allocated past each sampling request's scheduled tokens
            for the workers' draft model (speculative decoding with a draft model); 0: none.

    Attributes:
        queues: its requests and where each is
            (:class:`~pagedkv.engine.request_queues.RequestQueues`; tests read it, the engine
            asks the methods below).
        stats: its counters (:class:`~pagedkv.engine.stats.SchedulerStats`, live).

    Raises:
        ConfigError: :func:`~pagedkv.engine.request_limits.check_scheduler_options`, or swap
            without a KV tier.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheInterface,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        admission: str = "fcfs",
        preemption_mode: str = "recompute",
        wait_for_kv_loads: bool = False,
        num_speculative_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> None:
        check_scheduler_options(
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            enable_chunked_prefill,
            policy,
            admission,
            preemption_mode,
        )
        if preemption_mode == "swap" and not kv_cache_manager.has_kv_tier:
            raise ConfigError(
                "preemption_mode='swap' pages blocks out to the KV tier: set "
                "kv_offloading_size (and kv_offloading_backend)"
            )
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.admission = admission
        self.preemption_mode = preemption_mode
        self.stats = SchedulerStats()
        #: the requests and where each is (running, waiting, loading): their one owner.
        self.queues = queues = RequestQueues(
            kv_cache_manager, self.stats, policy, swap=preemption_mode == "swap"
        )
        #: what one request may ask for (add_request's rules).
        self.limits = RequestLimits(
            max_model_len,
            max_num_batched_tokens,
            kv_cache_manager.kv_cache_specs,
            kv_cache_manager.num_blocks - 1,  # block 0 is the null block
        )
        #: the collaborators, one job each (see the module's docstring).
        self.beams = BeamSearchGroups(queues, kv_cache_manager, self.stats, max_num_seqs)
        self.forks = SampleForks(
            queues, kv_cache_manager, self.stats, max_num_seqs, self.beams.reserved_seats
        )
        self.tier_loads = KVTierLoads(queues, kv_cache_manager, self.stats, wait_for_kv_loads)
        self.rejections = Rejections(queues, self.stats, self.beams, self.limits.num_usable_blocks)
        self.drafts = (
            SpecDecodeDrafts(
                max_model_len,
                queues.running,
                num_speculative_tokens,
                num_lookahead_tokens,
                max_num_batched_tokens,
            )
            if num_speculative_tokens
            else None
        )
        if self.drafts is not None:
            queues.set_release_hook(self.drafts.finished)
        self._scheduled_requests: list[Request] = []  # the last schedule()'s, in order

    @classmethod
    def from_config(
        cls,
        kv_cache_manager: KVCacheInterface,
        scheduler_config: SchedulerConfig,
        speculative_config: SpeculativeConfig | None = None,
    ) -> Scheduler:
        """The scheduler of the engine's resolved :class:`~pagedkv.config.SchedulerConfig` (and
        :class:`~pagedkv.config.SpeculativeConfig`: the workers propose the drafts)."""
        speculative = speculative_config
        return cls(
            kv_cache_manager,
            scheduler_config.max_num_seqs,
            scheduler_config.max_num_batched_tokens,
            scheduler_config.max_model_len,
            enable_chunked_prefill=scheduler_config.enable_chunked_prefill,
            policy=scheduler_config.policy,
            preemption_mode=scheduler_config.preemption_mode,
            wait_for_kv_loads=True,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
            num_lookahead_tokens=(
                speculative.num_speculative_tokens
                if speculative and speculative.uses_draft_model
                else 0
            ),
        )

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request (its ``sampling_params.max_tokens`` resolved:
        :func:`~pagedkv.sampling_params.resolve_max_tokens`).

        Raises:
            InvalidRequestError: a request id already in use, or a request that can never be
                served (:class:`~pagedkv.engine.request_limits.RequestLimits`, the beam
                search's and the fork's checks). Nothing is queued then.
        """
        if self.queues.id_in_use(request.request_id):
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        num_blocks_needed = self.limits.check(request)
        if request.beam_group is not None:
            self.beams.check(request.beam_group, num_blocks_needed)
        self.forks.check(request)
        self.queues.add(request)
        if request.beam_group is not None:
            self.beams.add(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside the step loop (abort, or a stop string the engine saw).

        Frees their blocks and forgets them. Unknown or already finished ids are ignored, so
        aborting twice is a no-op.

        Raises:
            InvalidRequestError: ``status`` is not a finished status.
        """
        if not status.is_finished:
            raise InvalidRequestError(f"finish_requests needs a finished status, got {status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        queues = self.queues
        for request_id in request_ids:
            request = queues.get(request_id)
            group = self.beams.find(request_id, request)
            if group is not None:  # a beam search ends whole: every live beam is freed
                self.beams.end(group, status)
            elif request is not None:
                queues.release(request, status)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, loading or running."""
        return bool(self.queues)

    def get_num_unfinished_requests(self) -> int:
        """Number of requests waiting, loading or running."""
        return len(self.queues)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request ``request_id`` (a sequence: one sample or one beam), or None."""
        return self.queues.get(request_id)

    def get_running_requests(self) -> list[Request]:
        """The running requests in scheduling order (the scheduler's own list: read it, do not
        change it)."""
        return self.queues.running

    def request_states(self) -> list[tuple[Request, str]]:
        """Every unfinished request with where it is: ``"running"`` (scheduling order), then
        ``"loading"`` (waiting for KV tier loads), then ``"waiting"`` (queue order)."""
        queues = self.queues
        states = [(request, "running") for request in queues.running]
        states += [(request, "loading") for request in queues.loading.values()]
        states += [(request, "waiting") for request in queues.waiting]
        return states

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, or loading their KV tier hits."""
        return self.queues.num_waiting

    @property
    def num_loading(self) -> int:
        """Requests waiting for the workers' KV tier loads (the workers must run a step to
        report them, even one without tokens)."""
        return len(self.queues.loading)

    @property
    def spec_decode_enabled(self) -> bool:
        """Whether decoding requests get draft tokens (speculative decoding)."""
        return self.drafts is not None

    def record_step_time(self, seconds: float) -> None:
        """The last scheduled step took ``seconds`` (wall, from :meth:`schedule` to its
        outputs): the draft-length rule learns it as the cost of a step of that many tokens
        when every request in it decoded (:meth:`SpecDecodeDrafts.observe_step_time
        <pagedkv.engine.spec_decode.drafts.SpecDecodeDrafts.observe_step_time>`); nothing
        without speculative decoding."""
        if self.drafts is not None:
            self.drafts.observe_step_time(seconds)

    def note_finished(self, request_ids: Iterable[str]) -> None:
        """Have the next step tell the workers to forget ``request_ids`` too: a request run
        outside the scheduler (the engine's health probe), or a step's finished ids the workers
        may not have applied (it failed)."""
        self.queues.note_finished(request_ids)

    def get_stats(self) -> SchedulerStats:
        """A snapshot of the counters (a copy: later steps do not change it)."""
        kv_cache = self.kv_cache_manager
        return dataclasses.replace(
            self.stats,
            num_running=len(self.queues.running),
            num_waiting=self.queues.num_waiting,
            kv_cache_usage=kv_cache.usage,
            num_used_blocks=kv_cache.num_blocks - 1 - kv_cache.num_free_blocks,
            num_shared_blocks=kv_cache.num_shared_blocks,
            spec_decoding=None if self.drafts is None else self.drafts.stats.copy(),
        )

    @property
    def scheduled_requests(self) -> list[Request]:
        """The requests of the last :meth:`schedule`, in scheduling order (their
        ``num_computed_tokens`` advanced by the step), until :meth:`update_from_output`."""
        return self._scheduled_requests

    # ------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, and allocate their KV blocks.

        Advances each scheduled request's ``num_computed_tokens`` by its scheduled tokens (the
        workers must compute them before :meth:`update_from_output`). Requests that can never
        fit are finished with status FINISHED_ERROR (reported by the next
        :meth:`update_from_output`).

        Returns:
            Plain data for the workers (:class:`SchedulerOutput`,
            :func:`~pagedkv.engine.scheduled_step.build_scheduler_output`): each request whole
            the first time it is scheduled, afterwards only what changed; the ids of requests
            finished since the last step.
        """
        step = ScheduledStep()
        queues = self.queues
        self.forks.fork_pending()
        token_budget = self._schedule_running(step)
        if not step.preempted_req_ids:  # newcomers only when this step had room for all
            self._admit_waiting(step, token_budget)
            if not step.requests and queues.running and queues.waiting:
                # Only beams waiting for their siblings run, and those siblings do not fit.
                self.beams.unpark(step)
                self._admit_waiting(step, token_budget)
        kv_cache = self.kv_cache_manager
        out = build_scheduler_output(step, kv_cache, queues.take_finished_ids(), self.stats)
        if self.drafts is not None:
            out.finished_token_ids = self.drafts.take_finished_token_ids()
            out.draft_paused_req_ids = self.drafts.take_paused()
            self.drafts.scheduled(len(step.requests), out.total_num_scheduled_tokens)
        self.forks.note_fork_points(step.requests)
        self._scheduled_requests = step.requests
        if step.requests:
            self.stats.num_steps += 1
        usage = kv_cache.usage
        if usage > self.stats.peak_kv_cache_usage:
            self.stats.peak_kv_cache_usage = usage
        return out

    def _schedule_running(self, step: ScheduledStep) -> int:
        """Schedule the running requests' decode tokens and the rest of their chunked prefills,
        in order, preempting (:meth:`_pick_victim`) while one does not fit. Returns the token
        budget left."""
        kv_cache = self.kv_cache_manager
        queues = self.queues
        running = queues.running
        resume_after_load = self.tier_loads.resume_after_load
        drafts = self.drafts
        token_budget = self.max_num_batched_tokens
        if drafts is not None:
            drafts.begin_step(
                may_admit=bool(queues.waiting)
                and len(running) + len(queues.loading) < self.max_num_seqs
            )
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if request.fork_children:  # an n > 1 parent stops at the fork point
                num_new_tokens = min(num_new_tokens, request.fork_at - request.num_computed_tokens)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            lookahead = 0
            if drafts is not None:
                num_new_tokens += drafts.propose(request, token_budget - num_new_tokens)
                lookahead = drafts.lookahead(request, request.num_computed_tokens + num_new_tokens)
            preempted_self = False
            while (
                new_blocks := kv_cache.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=lookahead
                )
            ) is None:
                if request.spec_token_ids or lookahead:  # drafts go before anyone is preempted
                    num_new_tokens -= drafts.drop(request)
                    lookahead = 0
                    continue
                victim = self._pick_victim()
                if running.index(victim) < req_index:  # only under policy="priority"
                    req_index -= 1
                token_budget += step.unschedule(victim)  # a victim scheduled this step
                queues.preempt(victim)
                step.preempted_req_ids.add(victim.request_id)
                if victim is request:
                    preempted_self = True
                    break
            if preempted_self:
                # Alone with the whole pool, it never fits. Otherwise go on (under "priority"
                # the requests after it may still run); ``req_index`` points at the next one.
                self.rejections.reject_if_never_fits(request, step)
                continue
            # Loaded after a preemption: the workers freed its table.
            resumed = bool(resume_after_load) and self.tier_loads.take_resumed(request)
            step.add(request, num_new_tokens, new_blocks, resumed, lookahead)
            token_budget -= num_new_tokens
            req_index += 1
        return token_budget

    def _admit_waiting(self, step: ScheduledStep, token_budget: int) -> None:
        """Admit waiting requests in queue order while seats, budget and blocks last: "fcfs"
        admission stops at the first that does not fit, "skip" tries those behind it."""
        kv_cache = self.kv_cache_manager
        queues = self.queues
        waiting = queues.waiting
        running = queues.running
        loading = queues.loading
        skip = self.admission == "skip"
        skipped: list[Request] = []
        seats_held = self.beams.seats()
        while (
            waiting
            and token_budget > 0
            and seats_held.room(len(running) + len(loading), self.max_num_seqs)
        ):
            request = queues.peek_waiting()
            if request.structured_output is not None and self.rejections.grammar_not_ready(
                request, skipped
            ):
                continue
            seats = self.beams.seats_needed(request) if request.beam_group is not None else 1
            if not seats_held.fits(len(running) + len(loading), seats, self.max_num_seqs):
                if not skip:
                    break  # FCFS: later requests wait behind this one
                skipped.append(queues.pop_waiting())
                continue
            blocks, num_computed_tokens, loads = self.tier_loads.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed_tokens
            released: list[Request] = []
            if request.fork_children:
                num_new_tokens, released = self.forks.admit(
                    request, num_computed_tokens, num_new_tokens
                )
            new_blocks = None  # without chunked prefill it waits for the whole budget
            lookahead = 0
            tried = num_new_tokens <= token_budget or self.enable_chunked_prefill
            if tried:
                num_new_tokens = min(num_new_tokens, token_budget)
                if self.drafts is not None and not loads:
                    lookahead = self.drafts.lookahead(request, num_computed_tokens + num_new_tokens)
                new_blocks = kv_cache.allocate_slots(
                    # a tier hit: only the hit's blocks now, the rest once it is loaded
                    request,
                    0 if loads else num_new_tokens,
                    num_computed_tokens,
                    blocks,
                    num_lookahead_tokens=lookahead,
                )
                if new_blocks is None and lookahead:  # the draft model's slots go first
                    lookahead = 0
                    new_blocks = kv_cache.allocate_slots(
                        request, num_new_tokens, num_computed_tokens, blocks
                    )
            if new_blocks is None:
                self.forks.keep(request, released)  # not admitted yet
                if tried and self.rejections.reject_if_never_fits(request, step):
                    continue
                if not skip:
                    break  # FCFS: later requests wait behind this one
                skipped.append(queues.pop_waiting())
                continue
            queues.pop_waiting()
            self.forks.queue_released(released)
            self.stats.count_first_admission(request, num_computed_tokens)
            request.num_computed_tokens = num_computed_tokens
            if self.tier_loads.admitted(request, blocks, loads):
                continue  # it waits for its loads (not the batch), then runs
            queues.run(request)
            seats_held.admitted(request, seats)
            # A request the workers already hold came back from preemption.
            step.add(request, num_new_tokens, None, request.num_sent_tokens > 0, lookahead)
            token_budget -= num_new_tokens
        for request in reversed(skipped):  # back in front, in their order
            queues.requeue(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Append the sampled tokens and finish requests that hit a stop condition.

        Args:
            scheduler_output: the output of the last :meth:`schedule`.
            runner_output: the workers' :class:`ModelRunnerOutput`: the ids of the requests that
                sampled and their tokens (a request samples when the step completes its prompt
                and every earlier token), logprobs, and the KV tier's load reports.

        Returns:
            The requests that got a token or finished in this step (including those rejected
            while scheduling; preempted requests are not listed), rejected ones first, then in
            scheduling order. Finished requests have freed their blocks and are forgotten.

        Raises:
            InvalidRequestError: the sampled tokens do not match the sampling requests (their
                number, or a request id that did not sample); nothing is changed then.
        """
        sampling, tokens, pooled = match_sampled_tokens(
            self._scheduled_requests, scheduler_output, runner_output
        )
        self.beams.check_rows(sampling, runner_output.logprobs)
        self._scheduled_requests = []
        self.tier_loads.update(runner_output)
        changed: list[Request] = self.rejections.take()
        now = time.monotonic()
        accepted = None
        if self.drafts is not None:  # checked: roll the rejected drafts back
            accepted = self.drafts.roll_back(
                sampling, tokens, runner_output.num_accepted_draft_tokens
            )
            self.drafts.receive(sampling, runner_output.draft_token_ids)
        finished, ready = append_sampled_tokens(
            sampling, tokens, runner_output.logprobs, changed, self.stats, now, accepted
        )
        if pooled:  # pooling requests whose prompt is done: finished with their vector
            finished += finish_pooled(pooled, changed, now)
        if finished:
            queues = self.queues
            queues.remove_running(finished)  # one pass; release() finds them out of it
            for request in finished:
                queues.release(request, request.status, now)
        for group in ready:  # a beam search's choice, between steps
            self.beams.step(group, changed, now)
        return changed

    # ------------------------------------------------------------------ preemption

    def _pick_victim(self) -> Request:
        running = self.queues.running
        if self.policy == "priority":
            return max(running, key=lambda r: (r.priority, r.arrival_time))
        return running[-1]
