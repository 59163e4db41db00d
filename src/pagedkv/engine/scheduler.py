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
                 build_scheduler_output(step)      what the workers get; num_computed advances
                 forks.note_fork_points(step)
    update_from_output():  tier_loads.update       loads done or failed, stores dropped
                           drafts.roll_back        rejected draft tokens' KV given up
                           drafts.receive          the workers' drafts for the next step
                           append_sampled_tokens   tokens appended, stop checks, beam reports
                           beams.step              a beam search's choice

(:mod:`~pagedkv.engine.sample_forks`, :mod:`~pagedkv.engine.kv_tier_loads`,
:mod:`~pagedkv.engine.beam_groups`, :mod:`~pagedkv.engine.scheduled_step`,
:mod:`~pagedkv.engine.sampled_tokens`; requests that can never run:
:mod:`~pagedkv.engine.rejections`; draft tokens: :mod:`~pagedkv.engine.spec_decode.drafts`).
A collaborator shares the scheduler's queues (``running``, ``waiting``, ``requests``), its KV
cache (any :class:`~pagedkv.core.interface.KVCacheInterface`) and its counters, and owns its own
state.

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
from pagedkv.engine.request_queue import FCFSQueue, PriorityQueue
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
        self.waiting: FCFSQueue | PriorityQueue = (
            PriorityQueue() if policy == "priority" else FCFSQueue()
        )
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        #: requests finished since the last schedule(): the next output tells the workers.
        self.finished_req_ids: set[str] = set()
        #: the collaborators, one job each (see the module's docstring).
        self.beams = BeamSearchGroups(self)
        self.forks = SampleForks(self)
        self.tier_loads = KVTierLoads(self, wait_for_kv_loads)
        self.rejections = Rejections(self)
        self.drafts = (
            SpecDecodeDrafts(self, num_speculative_tokens, num_lookahead_tokens)
            if num_speculative_tokens
            else None
        )
        self._scheduled_requests: list[Request] = []  # the last schedule()'s, in order
        #: what one request may ask for (add_request's rules).
        self.limits = RequestLimits(
            max_model_len,
            max_num_batched_tokens,
            kv_cache_manager.kv_cache_specs,
            kv_cache_manager.num_blocks - 1,  # block 0 is the null block
        )

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
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        num_blocks_needed = self.limits.check(request)
        if request.beam_group is not None:
            self.beams.check(request.beam_group, num_blocks_needed)
        self.forks.check(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)
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
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            group = self.beams.find(request_id, request)
            if group is not None:  # a beam search ends whole: every live beam is freed
                self.beams.end(group, status)
                continue
            if request is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.tier_loads.finish(request, status)
                continue
            if request.status == RequestStatus.RUNNING:
                finished.append(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self.free_request(request)
        if finished:
            gone = {id(r) for r in finished}
            self.running[:] = [r for r in self.running if id(r) not in gone]

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """Number of requests waiting or running."""
        return len(self.requests)

    def get_stats(self) -> SchedulerStats:
        """A snapshot of the counters (a copy: later steps do not change it)."""
        kv_cache = self.kv_cache_manager
        return dataclasses.replace(
            self.stats,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.tier_loads),
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
        self.forks.fork_pending()
        token_budget = self._schedule_running(step)
        if not step.preempted_req_ids:  # newcomers only when this step had room for all
            self._admit_waiting(step, token_budget)
            if not step.requests and self.running and self.waiting:
                # Only beams waiting for their siblings run, and those siblings do not fit.
                self.beams.unpark(step)
                self._admit_waiting(step, token_budget)
        kv_cache = self.kv_cache_manager
        out = build_scheduler_output(step, kv_cache, self.finished_req_ids, self.stats)
        if self.drafts is not None:
            out.finished_token_ids = self.drafts.take_finished_token_ids()
        self.finished_req_ids = set()
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
        running = self.running
        resume_after_load = self.tier_loads.resume_after_load
        drafts = self.drafts
        token_budget = self.max_num_batched_tokens
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
                running.remove(victim)
                token_budget += step.unschedule(victim)  # a victim scheduled this step
                self.preempt(victim, step)
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
        waiting = self.waiting
        running = self.running
        loading = self.tier_loads.loading
        skip = self.admission == "skip"
        skipped: list[Request] = []
        seats_held = self.beams.seats()
        while (
            waiting
            and token_budget > 0
            and seats_held.room(len(running) + len(loading), self.max_num_seqs)
        ):
            request = waiting.peek()
            if request.structured_output is not None and self.rejections.grammar_not_ready(
                request, skipped
            ):
                continue
            seats = self.beams.seats_needed(request) if request.beam_group is not None else 1
            if not seats_held.fits(len(running) + len(loading), seats, self.max_num_seqs):
                if not skip:
                    break  # FCFS: later requests wait behind this one
                skipped.append(waiting.pop())
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
                skipped.append(waiting.pop())
                continue
            waiting.pop()
            self.forks.queue_released(released)
            self.stats.count_first_admission(request, num_computed_tokens)
            request.num_computed_tokens = num_computed_tokens
            if self.tier_loads.admitted(request, blocks, loads):
                continue  # it waits for its loads (not the batch), then runs
            request.status = RequestStatus.RUNNING
            running.append(request)
            seats_held.admitted(request, seats)
            # A request the workers already hold came back from preemption.
            step.add(request, num_new_tokens, None, request.num_sent_tokens > 0, lookahead)
            token_budget -= num_new_tokens
        for request in reversed(skipped):  # back in front, in their order
            waiting.add_front(request)

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
            gone = {id(r) for r in finished}
            self.running[:] = [r for r in self.running if id(r) not in gone]
            for request in finished:
                self.free_request(request, now)
        for group in ready:  # a beam search's choice, between steps
            self.beams.step(group, changed, now)
        return changed

    # ------------------------------------------------------------------ preemption, rejection

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def preempt(self, request: Request, step: ScheduledStep) -> None:
        """Preempt ``request`` (out of the running list already): its blocks are freed (paged
        out first under ``preemption_mode="swap"``), it recomputes from 0, and it goes back to
        the front of the waiting queue."""
        if self.preemption_mode == "swap":
            self.kv_cache_manager.swap_out(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.add_front(request)
        step.preempted_req_ids.add(request.request_id)

    def free_request(self, request: Request, now: float | None = None) -> None:
        """Forget a finished ``request``: free its blocks and its constraint, stamp its finish
        time, and tell the workers with the next step."""
        self.kv_cache_manager.free(request)
        if request.structured_output is not None:
            request.structured_output.free()
        if self.drafts is not None:
            self.drafts.finished(request)
        request.finished_time = time.monotonic() if now is None else now
        self.requests.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
