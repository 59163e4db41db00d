"""Continuous-batching scheduler over the paged KV cache (vLLM V1 style: no prefill/decode phases).

Each request has ``num_computed_tokens`` (tokens whose KV is in the cache); every step gives each
scheduled request ``num_scheduled_tokens`` more, within a token budget (max_num_batched_tokens) and
a request cap (max_num_seqs). A prompt longer than the budget is split over several steps (chunked
prefill) and shares steps with other requests' decode tokens::

    step k:  [ req A: 1 decode token | req B: 1 decode token | req C: 254 prompt tokens (chunk) ]
    step k+1:[ req A: 1              | req B: 1              | req C: 146 (rest) -> samples ]

Order within a step: running requests first (allocate_slots; when no block can be had, preempt the
newest running request, or the lowest-priority one under policy="priority": its blocks are freed,
num_computed_tokens = 0, and it goes back to the front of the waiting queue; its full blocks stay in
the prefix cache, so resuming it is usually cheap), then waiting requests (get_computed_blocks for
the prefix-cache hit, then allocate_slots) in queue order. Admission "fcfs" (the default, vLLM's)
stops at the first request that does not fit, so big requests are not starved by small ones;
admission "skip" tries the requests behind it (more concurrency, but a big request can wait
forever while small ones keep coming; the simulator compares the two).

The scheduler is torch-free and model-independent: anything that turns a :class:`SchedulerOutput`
into one sampled token per sampling request can drive it (the engine's model runner, or the
simulator's fake model). See docs/engine.md for the driving loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

from pagedkv.config import SchedulerConfig
from pagedkv.core.interface import KVCacheInterface
from pagedkv.core.kv_cache_blocks import KVCacheBlocks
from pagedkv.core.spec import max_num_blocks_per_request
from pagedkv.engine.beam_search import BeamSearchGroup
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_queue import FCFSQueue, PriorityQueue
from pagedkv.engine.stats import SchedulerStats
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.validation import check_int
from pagedkv.worker.outputs import ModelRunnerOutput
from pagedkv.worker.scheduler_output import NewRequestData, SchedulerOutput

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
ADMISSION_POLICIES = ("fcfs", "skip")


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

    Raises:
        ConfigError: a value out of range, an unknown policy or admission, or chunked prefill
            off with a budget smaller than max_model_len (a long request could never be
            scheduled).
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
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            check_int(name, value, 1)
        if policy not in POLICIES:
            raise ConfigError(f"unknown scheduling policy {policy!r}; choose one of {POLICIES}")
        if admission not in ADMISSION_POLICIES:
            raise ConfigError(
                f"unknown admission {admission!r}; choose one of {ADMISSION_POLICIES}"
            )
        if preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(
                f"unknown preemption_mode {preemption_mode!r}; choose one of {PREEMPTION_MODES}"
            )
        if preemption_mode == "swap" and not kv_cache_manager.has_kv_tier:
            raise ConfigError(
                "preemption_mode='swap' pages blocks out to the KV tier: set "
                "kv_offloading_size (and kv_offloading_backend)"
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_model_len}): a prompt (or a preempted request) "
                "of max_model_len tokens must fit in one step; enable chunked prefill or raise "
                "the budget"
            )
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.admission = admission
        self.preemption_mode = preemption_mode
        self.wait_for_kv_loads = wait_for_kv_loads
        self.waiting: FCFSQueue | PriorityQueue = (
            PriorityQueue() if policy == "priority" else FCFSQueue()
        )
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        #: requests holding blocks while the workers load their KV tier hits
        #: (WAITING_FOR_REMOTE_KVS): neither waiting nor running; each keeps a seat.
        self._loading: dict[str, Request] = {}
        #: loaded requests the workers held before (preempted): their first step after the
        #: load sends their whole block table.
        self._resume_after_load: set[str] = set()
        self.stats = SchedulerStats()
        #: requests finished since the last schedule(): the next output tells the workers.
        self.finished_req_ids: set[str] = set()
        self._rejected: list[Request] = []  # rejected while scheduling, not yet reported
        self._pending_forks: list[Request] = []  # parents that reached fork_at last step
        #: unfinished beam searches, by their root beam's id (what abort and the outputs name)
        self._beam_groups: dict[str, BeamSearchGroup] = {}
        self._scheduled_requests: list[Request] = []  # the last schedule()'s, in order
        self._num_usable_blocks = kv_cache_manager.num_blocks - 1  # block 0 is the null block
        self._kv_cache_specs = tuple(kv_cache_manager.kv_cache_specs)

    @classmethod
    def from_config(
        cls, kv_cache_manager: KVCacheInterface, scheduler_config: SchedulerConfig
    ) -> Scheduler:
        """The scheduler of the engine's resolved :class:`~pagedkv.config.SchedulerConfig`."""
        return cls(
            kv_cache_manager,
            scheduler_config.max_num_seqs,
            scheduler_config.max_num_batched_tokens,
            scheduler_config.max_model_len,
            enable_chunked_prefill=scheduler_config.enable_chunked_prefill,
            policy=scheduler_config.policy,
            preemption_mode=scheduler_config.preemption_mode,
            wait_for_kv_loads=True,
        )

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request; resolves ``request.max_tokens`` from its sampling params.

        Raises:
            InvalidRequestError: the request can never be served: an empty prompt, prompt +
                max_tokens beyond max_model_len, more blocks than the whole pool, or a request
                id already in use. Nothing is queued then.
        """
        num_prompt_tokens = request.num_prompt_tokens
        if num_prompt_tokens == 0:
            raise InvalidRequestError(
                f"request {request.request_id!r}: the prompt is empty", param="prompt"
            )
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt_tokens
            if max_tokens < 1:
                raise InvalidRequestError(
                    f"request {request.request_id!r}: the prompt has {num_prompt_tokens} tokens, "
                    f"which leaves no room to generate within max_model_len={self.max_model_len}",
                    param="prompt",
                )
        elif num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"request {request.request_id!r}: prompt ({num_prompt_tokens} tokens) + "
                f"max_tokens ({max_tokens}) = {num_prompt_tokens + max_tokens} tokens exceeds "
                f"max_model_len={self.max_model_len}; shorten the prompt or lower max_tokens",
                param="max_tokens",
            )
        num_blocks_needed = max_num_blocks_per_request(
            self._kv_cache_specs, num_prompt_tokens + max_tokens, self.max_num_batched_tokens
        )
        if num_blocks_needed > self._num_usable_blocks:
            raise InvalidRequestError(
                f"request {request.request_id!r}: prompt + max_tokens = "
                f"{num_prompt_tokens + max_tokens} tokens needs {num_blocks_needed} KV blocks but "
                f"the whole pool has {self._num_usable_blocks}; lower max_tokens or grow the "
                "KV cache",
                param="max_tokens",
            )
        group = request.beam_group
        if group is not None:
            self._check_beam_group(group, num_blocks_needed)
        for child in request.fork_children:
            if child.request_id in self.requests or child.request_id == request.request_id:
                raise InvalidRequestError(f"request id {child.request_id!r} is already in use")
            if child.prompt_token_ids != request.prompt_token_ids:
                raise InvalidRequestError("fork children must have their parent's prompt")
        if request.fork_children and not 1 <= request.fork_at < num_prompt_tokens:
            raise InvalidRequestError(
                f"fork_at must be in [1, {num_prompt_tokens}), got {request.fork_at}"
            )
        request.max_tokens = max_tokens
        request.status = RequestStatus.WAITING
        for child in request.fork_children:
            child.max_tokens = max_tokens
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if group is not None:
            self._beam_groups[request.request_id] = group

    def _check_beam_group(self, group: BeamSearchGroup, num_blocks_per_beam: int) -> None:
        """Refuse a beam search that could never run: more beams than seats, or more blocks
        than the pool when every beam holds its own (no sharing left: after preemptions each
        beam may recompute alone), so that a group alone in the engine always fits."""
        width = group.beam_width
        if width > self.max_num_seqs:
            raise InvalidRequestError(
                f"beam_width ({width}) must be <= max_num_seqs ({self.max_num_seqs}): every beam "
                "is a running sequence",
                param="beam_width",
            )
        if width * num_blocks_per_beam > self._num_usable_blocks:
            raise InvalidRequestError(
                f"beam search with beam_width={width} needs up to {width} x "
                f"{num_blocks_per_beam} KV blocks but the whole pool has "
                f"{self._num_usable_blocks}; lower beam_width or max_tokens, or grow the KV cache",
                param="beam_width",
            )

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
            group = self._beam_groups.get(request_id)
            if group is None and request is not None:
                group = request.beam_group
            if group is not None:  # a beam search ends whole: every live beam is freed
                self._end_beam_group(group, status)
                continue
            if request is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Its blocks are being written by the workers: freed when the loads end.
                request.status = status
                request.finished_time = time.monotonic()
                if request.structured_output is not None:
                    request.structured_output.free()
                self.requests.pop(request_id, None)
                continue
            if request.status == RequestStatus.RUNNING:
                finished.append(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
        if finished:
            gone = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in gone]

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """Number of requests waiting or running."""
        return len(self.requests)

    def get_stats(self) -> SchedulerStats:
        """A snapshot of the counters (a copy: later steps do not change it)."""
        return dataclasses.replace(
            self.stats,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self._loading),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_used_blocks=self.kv_cache_manager.num_blocks
            - 1
            - self.kv_cache_manager.num_free_blocks,
            num_shared_blocks=self.kv_cache_manager.num_shared_blocks,
        )

    @property
    def scheduled_requests(self) -> list[Request]:
        """The requests of the last :meth:`schedule`, in scheduling order (their
        ``num_computed_tokens`` advanced by the step), until :meth:`update_from_output`."""
        return self._scheduled_requests

    @property
    def loading_requests(self) -> list[Request]:
        """The requests waiting for their KV tier loads (WAITING_FOR_REMOTE_KVS: they hold
        blocks, but neither wait nor run), in admission order; a copy."""
        return list(self._loading.values())

    # ------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, and allocate their KV blocks.

        Advances each scheduled request's ``num_computed_tokens`` by its scheduled tokens (the
        workers must compute them before :meth:`update_from_output`). Requests that can never
        fit are finished with status FINISHED_ERROR (reported by the next
        :meth:`update_from_output`).

        Returns:
            Plain data for the workers (:class:`SchedulerOutput`): each request whole the first
            time it is scheduled, afterwards only its new token ids and block ids; the ids of
            requests finished since the last step. Building it costs O(1) per scheduled decode
            request, whatever its context length.
        """
        manager = self.kv_cache_manager
        step = _Step()
        token_budget = self.max_num_batched_tokens
        if self._pending_forks:
            self._fork_children()

        # 1) Running requests: decode tokens and the rest of chunked prefills.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if request.fork_children:  # an n > 1 parent stops at the fork point
                num_new_tokens = min(num_new_tokens, request.fork_at - request.num_computed_tokens)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            preempted_self = False
            while (new_blocks := manager.allocate_slots(request, num_new_tokens)) is None:
                victim = self._pick_victim()
                if self.running.index(victim) < req_index:  # only under policy="priority"
                    req_index -= 1
                self.running.remove(victim)
                undone = step.unschedule(victim)
                if undone:  # a victim already scheduled this step: give back its tokens
                    token_budget += undone
                self._preempt(victim, step)
                if victim is request:
                    preempted_self = True
                    break
            if preempted_self:
                # Alone with the whole pool, it never fits. Otherwise go on: under FCFS it was
                # the last running request, but under policy="priority" the running list is in
                # admission order, so requests after it may be of higher priority and can still
                # run (a step never schedules nothing while a running request could run).
                # ``req_index`` now points at the request after it.
                self._reject_if_never_fits(request, step)
                continue
            resumed = False
            if self._resume_after_load and request.request_id in self._resume_after_load:
                self._resume_after_load.discard(request.request_id)
                resumed = True  # loaded after a preemption: the workers freed its table
            step.add(request, num_new_tokens, new_blocks, resumed)
            token_budget -= num_new_tokens
            req_index += 1

        # 2) Waiting requests, unless this step had to preempt (no room for newcomers).
        if not step.preempted_req_ids:
            self._admit_waiting(step, token_budget)
            if not step.requests and self.running and self.waiting:
                # Only beams waiting for their siblings run, and those siblings do not fit.
                self._unpark_beam_groups(step)
                self._admit_waiting(step, token_budget)

        # 3) Advance num_computed_tokens and say what changed since the workers last heard.
        blocks_to_copy = manager.take_blocks_to_copy()
        copied = self._copied_tables(step, blocks_to_copy) if any(blocks_to_copy) else None
        out = SchedulerOutput(
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=step.total_num_scheduled_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=step.preempted_req_ids,
            blocks_to_copy=blocks_to_copy if copied is not None else (),
            kv_tier_ops=manager.take_tier_ops(),
        )
        self.finished_req_ids = set()
        cached = out.scheduled_cached_reqs
        now = time.monotonic()
        for request, new_blocks, resumed in zip(
            step.requests, step.new_blocks, step.resumed, strict=True
        ):
            num_computed_tokens = request.num_computed_tokens
            num_sent_tokens = request.num_sent_tokens
            num_tokens = request.num_tokens
            if num_sent_tokens == 0:
                out.scheduled_new_reqs.append(
                    NewRequestData(
                        request.request_id,
                        list(request.prompt_token_ids),
                        request.sampling_params,
                        manager.get_block_ids(request.request_id),
                        num_computed_tokens,
                        tuple(request.eos_token_ids),
                        request.output_token_ids,  # a forked beam's, else none
                    )
                )
            else:
                cached.req_ids.append(request.request_id)
                cached.resumed_from_preemption.append(resumed)
                cached.new_token_ids.append(
                    request.all_token_ids[num_sent_tokens:num_tokens]
                    if num_tokens > num_sent_tokens
                    else []
                )
                if copied is not None and request.request_id in copied:
                    # copy-on-write replaced a block of its table: send the table whole
                    resumed = True
                    cached.resumed_from_preemption[-1] = True
                if resumed:  # its blocks were freed: the whole table is new
                    cached.new_block_ids.append(manager.get_block_ids(request.request_id))
                elif not new_blocks or not any(new_blocks.blocks):
                    cached.new_block_ids.append(None)
                else:
                    cached.new_block_ids.append(new_blocks.get_block_ids())
                cached.num_computed_tokens.append(num_computed_tokens)
            request.num_sent_tokens = num_tokens
            request.num_computed_tokens = (
                num_computed_tokens + out.num_scheduled_tokens[request.request_id]
            )
            if request.fork_children and request.num_computed_tokens == request.fork_at:
                self._pending_forks.append(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        self._scheduled_requests = step.requests
        if step.requests:
            self.stats.num_steps += 1
        usage = manager.usage
        if usage > self.stats.peak_kv_cache_usage:
            self.stats.peak_kv_cache_usage = usage
        return out

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
        scheduled = self._scheduled_requests
        if len(scheduled) != scheduler_output.num_reqs:
            raise InvalidRequestError("update_from_output needs the output of the last schedule()")
        sampling = [r for r in scheduled if r.num_computed_tokens >= r.num_tokens]
        by_id = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
        missing = [r.request_id for r in sampling if r.request_id not in by_id]
        if missing or len(by_id) != len(sampling):
            raise InvalidRequestError(
                f"the sampled tokens are for requests {sorted(by_id)}, the sampling requests "
                f"are {sorted(r.request_id for r in sampling)}"
            )
        tokens = [by_id[r.request_id] for r in sampling]
        logprobs = runner_output.logprobs
        no_row = [
            r.request_id
            for r in sampling
            if r.beam_group is not None
            and not r.is_finished
            and (
                r.request_id not in logprobs
                or len(logprobs[r.request_id].token_ids[0]) <= r.beam_group.num_candidates
            )
        ]
        if no_row:
            raise InvalidRequestError(
                f"beams {no_row} sampled without their candidates: a beam search needs the "
                "runner's logprobs rows (a ModelRunnerOutput, top-K of each beam)"
            )
        self._scheduled_requests = []
        if runner_output.dropped_kv_stores:
            self.kv_cache_manager.discard_tier_entries(
                runner_output.dropped_kv_stores, failed_load=False
            )
        if self._loading:
            finished_loads = runner_output.finished_kv_loads
            failed_loads = runner_output.failed_kv_loads
            if finished_loads or failed_loads:
                self._finish_kv_loads(finished_loads, failed_loads)
        changed: list[Request] = self._rejected
        self._rejected = []
        finished: list[Request] = []
        ready: list[BeamSearchGroup] = []  # beam searches whose every beam has reported
        now = time.monotonic()
        for request, token_id in zip(sampling, tokens, strict=True):
            if request.is_finished:  # aborted between schedule() and now
                continue
            group = request.beam_group
            if group is not None:  # a beam: its candidates go to its group, no token yet
                row = logprobs[request.request_id]
                if group.report(request, row.token_ids[0][1:], row.logprobs[0][1:]):
                    ready.append(group)
                continue
            request.append_output_token_ids(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            self.stats.num_generation_tokens += 1
            changed.append(request)
            constraint = request.structured_output
            if constraint is not None and not constraint.accept(token_id):
                # Only when every token was masked (min_tokens hid the end the constraint
                # needed): the output cannot go on under the constraint.
                request.status = RequestStatus.FINISHED_ERROR
                request.error = (
                    f"request {request.request_id!r}: token {token_id} breaks its "
                    "structured_outputs constraint (no allowed token was left: min_tokens or "
                    "stop settings may exclude the constraint's end)"
                )
                finished.append(request)
            elif request.check_stop(token_id):
                finished.append(request)
            elif constraint is not None and constraint.is_terminated():
                request.status = RequestStatus.FINISHED_STOPPED  # the constraint is complete
                finished.append(request)
        if finished:
            gone = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in gone]
            for request in finished:
                self._free_request(request, now)
        for group in ready:
            self._step_beam_group(group, changed, now)
        return changed

    # ------------------------------------------------------------------ beam search

    def _step_beam_group(self, group: BeamSearchGroup, changed: list[Request], now: float) -> None:
        """Apply a beam search's choice once every live beam has reported (between steps):
        free the beams not chosen, fork a child from a beam chosen more than once (it shares
        the parent's blocks; the partially filled last one is copied on write), then give each
        next beam its token. A child that gets no free block (or whose parent is not running,
        preempted since it reported) is queued to recompute its KV instead (prefix-cache hits
        on the shared full blocks). When the search is over, its root is reported changed."""
        decision = group.step()
        manager = self.kv_cache_manager
        for beam in decision.dropped:
            self._remove_beam(beam)
            beam.status = RequestStatus.FINISHED_STOPPED
            self._free_request(beam, now)
        for request, parent, _ in decision.continuations:
            if request is parent:
                continue
            self.requests[request.request_id] = request
            request.num_computed_tokens = parent.num_computed_tokens
            if (
                parent.status == RequestStatus.RUNNING
                and parent.num_computed_tokens > 0
                and manager.fork(parent, request)
            ):
                request.status = RequestStatus.RUNNING
                self.running.insert(self.running.index(parent) + 1, request)
                self.stats.num_forks += 1
            else:
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                self.waiting.add_front(request)
        for request, _, token_id in decision.continuations:
            request.append_output_token_ids(token_id)
            self.stats.num_generation_tokens += 1
        root = group.root
        if root.first_token_time is None:
            root.first_token_time = now
        if decision.done:
            del self._beam_groups[root.request_id]
            changed.append(root)

    def _end_beam_group(self, group: BeamSearchGroup, status: RequestStatus) -> None:
        """End a beam search from outside the step loop (abort, a failed step): every live
        beam is freed with ``status``; the search has no result."""
        if group.done:
            return
        error = group.root.error if status == RequestStatus.FINISHED_ERROR else None
        for beam in group.abort(error):
            self._remove_beam(beam)
            beam.status = status
            self._free_request(beam)
        group.root.status = status
        self._beam_groups.pop(group.root.request_id, None)

    def _remove_beam(self, beam: Request) -> None:
        """Take a live beam out of the running list or the waiting queue."""
        if beam.status == RequestStatus.RUNNING:
            self.running.remove(beam)
        else:
            self.waiting.remove(beam)

    def _beam_seats(self) -> tuple[int, int]:
        """``(reserved, waiting)``: seats (of max_num_seqs) held for beams not running by the
        beam searches that have a running beam, and how many of their beams wait for one.

        A beam search holds ``beam_width`` seats while any of its beams runs, so its forks and
        its preempted beams always find a seat (vLLM V0 counted a sequence group's most
        running sequences the same way); one with no running beam holds none."""
        reserved = waiting = 0
        for group in self._beam_groups.values():
            beams = group.beams
            num_running = sum(1 for b in beams if b.status == RequestStatus.RUNNING)
            if num_running:
                reserved += group.beam_width - num_running
                waiting += len(beams) - num_running
        return reserved, waiting

    def _seats_needed(self, request: Request) -> int:
        """Seats ``request`` takes when admitted: 1; a beam's search takes beam_width when none
        of its beams runs, else none (one of its reserved seats)."""
        group = request.beam_group
        if group is None:
            return 1
        if any(b.status == RequestStatus.RUNNING for b in group.beams):
            return 0
        return group.beam_width

    def _unpark_beam_groups(self, step: _Step) -> None:
        """Called when a step would compute nothing while requests wait: every running
        request is then a beam waiting for a sibling that does not fit (the parked beams hold
        the blocks it needs). Preempt every such beam search whole (its running beams freed,
        as in a preemption) and queue its beams together at the front, oldest search first,
        so the next admissions bring one search in whole (each fits alone: add_request checked
        it) instead of parts of several."""
        groups = []
        for request in self.running:
            group = request.beam_group
            if group is not None and group not in groups:
                groups.append(group)
        for group in reversed(groups):
            beams = group.beams
            for beam in beams:
                if beam.status == RequestStatus.RUNNING:
                    self.running.remove(beam)
                    self.kv_cache_manager.free(beam)
                    beam.status = RequestStatus.PREEMPTED
                    beam.num_computed_tokens = 0
                    beam.num_preemptions += 1
                    self.stats.num_preemptions += 1
                    step.preempted_req_ids.add(beam.request_id)
                else:
                    self.waiting.remove(beam)
            for beam in reversed(beams):
                self.waiting.add_front(beam)

    # ------------------------------------------------------------------ helpers

    def _admit_waiting(self, step: _Step, token_budget: int) -> None:
        manager = self.kv_cache_manager
        waiting = self.waiting
        skip = self.admission == "skip"
        skipped: list[Request] = []
        reserved, reserved_waiting = self._beam_seats() if self._beam_groups else (0, 0)
        loading = self._loading
        wait_for_loads = self.wait_for_kv_loads
        while (
            waiting
            and token_budget > 0
            and (
                len(self.running) + len(loading) + reserved < self.max_num_seqs or reserved_waiting
            )
        ):
            request = waiting.peek()
            constraint = request.structured_output
            if constraint is not None and not constraint.ready():
                # Its grammar is still compiling (vLLM's WAITING_FOR_FSM): it waits, not the
                # requests behind it, whatever the admission policy.
                skipped.append(waiting.pop())
                continue
            if constraint is not None and constraint.error is not None:
                waiting.pop()
                self._reject(request, f"request {request.request_id!r}: {constraint.error}")
                continue
            seats = self._seats_needed(request) if request.beam_group is not None else 1
            if len(self.running) + len(loading) + reserved + seats > self.max_num_seqs:
                if not skip:
                    break  # FCFS: later requests wait behind this one
                skipped.append(waiting.pop())
                continue
            computed_blocks, num_computed_tokens = manager.get_computed_blocks(request)
            tier_hashes = computed_blocks.tier_hashes if wait_for_loads else ()
            if tier_hashes and request.beam_group is not None:
                # A beam's seats are reserved with its group's: it recomputes instead of
                # waiting for a load (its pool hit stays).
                num_computed_tokens -= len(tier_hashes) * manager.block_size
                computed_blocks = (
                    KVCacheBlocks(computed_blocks.blocks)
                    if num_computed_tokens
                    else manager.empty_kv_cache_blocks
                )
                tier_hashes = ()
            num_new_tokens = request.num_tokens - num_computed_tokens
            released: list[Request] = []
            if request.fork_children:  # an n > 1 parent stops at the fork point...
                if num_computed_tokens < request.fork_at:
                    num_new_tokens = request.fork_at - num_computed_tokens
                else:  # ...unless the prefix cache has it all: then each sample hits it too
                    released, request.fork_children = request.fork_children, []
            tried = False
            if num_new_tokens > token_budget and not self.enable_chunked_prefill:
                new_blocks = None  # waits for a step with the whole budget free
            else:
                num_new_tokens = min(num_new_tokens, token_budget)
                new_blocks = manager.allocate_slots(
                    # a tier hit: only the hit's blocks now, the rest once it is loaded
                    request,
                    0 if tier_hashes else num_new_tokens,
                    num_computed_tokens,
                    computed_blocks,
                )
                tried = True
            if new_blocks is None:
                request.fork_children = released or request.fork_children  # not admitted yet
                if tried and self._reject_if_never_fits(request, step):
                    continue
                if not skip:
                    break  # FCFS: later requests wait behind this one
                skipped.append(waiting.pop())
                continue
            waiting.pop()
            for child in reversed(released):  # plain requests now, right behind their parent
                self.requests[child.request_id] = child
                waiting.add_front(child)
            if request.num_cached_tokens < 0:  # first admission (not a resumption)
                # The one definition of the prefix-cache counters (docs/engine.md): each
                # request counts once, at its first admission, if it can hit at all.
                request.num_cached_tokens = num_computed_tokens
                if request.block_hasher is not None and not request.skip_reading_prefix_cache:
                    self.stats.prefix_cache_queries += request.num_prompt_tokens
                    self.stats.prefix_cache_hits += num_computed_tokens
                self.stats.num_prompt_tokens += request.num_prompt_tokens
            request.num_computed_tokens = num_computed_tokens
            if not wait_for_loads and computed_blocks.tier_hashes:
                manager.finish_tier_loads(request.request_id)  # no workers: loads are instant
            if tier_hashes:
                # The workers load the tier hit; it waits (not the batch) until they report
                # the loads done (_finish_kv_loads), then runs from the loaded prefix.
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                loading[request.request_id] = request
                self.stats.num_kv_tier_loads += 1
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.beam_group is not None:  # its search's seats: see _beam_seats
                if seats:  # its first running beam: the others (all queued) are reserved for
                    reserved += seats - 1
                    reserved_waiting += len(request.beam_group.beams) - 1
                else:
                    reserved -= 1
                    reserved_waiting -= 1
            # A request the workers already hold came back from preemption.
            step.add(request, num_new_tokens, None, request.num_sent_tokens > 0)
            token_budget -= num_new_tokens
        for request in reversed(skipped):  # back in front, in their order
            waiting.add_front(request)

    def _reject_if_never_fits(self, request: Request, step: _Step) -> bool:
        """Finish ``request`` with an error if allocation failed while no other request holds
        blocks: the whole pool was free, so it can never fit. Returns True when rejected."""
        if self.running or step.requests or self._loading:
            return False
        self.waiting.remove(request)
        self._reject(
            request,
            f"request {request.request_id!r} needs more KV blocks for {request.num_tokens} "
            f"tokens than the whole pool ({self._num_usable_blocks} blocks) can give",
        )
        return True

    def _reject(self, request: Request, error: str) -> None:
        """Finish ``request`` (out of the waiting queue already) with FINISHED_ERROR and
        ``error``, with its fork children or its whole beam search; reported by the next
        :meth:`update_from_output`."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = error
        self.stats.num_rejected += 1
        self._free_request(request)
        group = request.beam_group
        if group is not None:  # its beam search ends with it (reported through its root)
            group.root.error = request.error
            self._end_beam_group(group, RequestStatus.FINISHED_ERROR)
            self._rejected.append(group.root)
            return
        self._rejected.append(request)
        for child in request.fork_children:  # its samples end with it
            child.status = RequestStatus.FINISHED_ERROR
            child.error = request.error
            self._rejected.append(child)
        request.fork_children = []

    def _fork_children(self) -> None:
        """Fork the children of the parents that computed all their prompt but the last token
        (between steps): each child maps the parent's blocks (the manager's ``fork``; the
        shared partially filled block is copied on the first write) and runs from there. A
        child that has no seat (max_num_seqs) or no room for its first block queues as a plain
        request instead (prefix-cache hits on the parent's full blocks, the rest recomputed)."""
        manager = self.kv_cache_manager
        for parent in self._pending_forks:
            children, parent.fork_children = parent.fork_children, []
            forkable = (
                parent.status == RequestStatus.RUNNING
                and parent.num_computed_tokens == parent.fork_at
            )
            if not children:
                continue
            if not forkable:  # preempted since: it forks when it gets there again
                parent.fork_children = children
                continue
            at = self.running.index(parent) + 1
            reserved = self._beam_seats()[0] if self._beam_groups else 0
            for child in children:
                self.requests[child.request_id] = child
                child.num_computed_tokens = parent.fork_at
                if len(self.running) + reserved < self.max_num_seqs and manager.fork(parent, child):
                    child.status = RequestStatus.RUNNING
                    child.num_cached_tokens = parent.num_cached_tokens
                    self.running.insert(at, child)
                    at += 1
                    self.stats.num_forks += 1
                else:
                    child.num_computed_tokens = 0
                    child.status = RequestStatus.WAITING
                    self.waiting.add(child)
        self._pending_forks = []

    def _copied_tables(self, step: _Step, blocks_to_copy) -> set[str]:
        """Ids of the step's requests whose table had a block replaced by copy-on-write (the
        block at their ``num_computed_tokens``, now a copy's ``dst``): their tables go whole."""
        manager = self.kv_cache_manager
        block_size = manager.block_size
        dsts = [{dst for _, dst in copies} for copies in blocks_to_copy]
        copied = set()
        for request in step.requests:
            index = request.num_computed_tokens // block_size
            for g, ids in enumerate(manager.get_block_ids(request.request_id)):
                if dsts[g] and index < len(ids) and ids[index] in dsts[g]:
                    copied.add(request.request_id)
                    break
        self.stats.num_cow_copies += sum(len(copies) for copies in blocks_to_copy)
        return copied

    def _finish_kv_loads(self, finished: Iterable[str], failed: dict[str, list[str]]) -> None:
        """Requests whose tier loads the workers reported done. All good: the request runs
        from its loaded prefix (it joins the running requests with the seat it kept; its
        loaded blocks enter the prefix cache with its next allocation). Some failed: the tier
        forgets the bad entries and the request goes back to the front of the waiting queue
        with its blocks freed (never cached), so it recomputes what the tier could not give;
        its output does not change. One finished meanwhile (aborted): its blocks are freed."""
        manager = self.kv_cache_manager
        loading = self._loading
        for keys in failed.values():
            manager.discard_tier_entries(keys)
        for request_id in (*finished, *failed):
            request = loading.pop(request_id, None)
            if request is None:
                continue
            manager.finish_tier_loads(request_id)
            if request.is_finished:
                manager.free(request)
                self.finished_req_ids.add(request_id)
            elif request_id in failed:
                manager.free(request)
                request.status = (
                    RequestStatus.PREEMPTED if request.num_sent_tokens else RequestStatus.WAITING
                )
                request.num_computed_tokens = 0
                self.stats.num_kv_tier_load_failures += 1
                self.waiting.add_front(request)
            else:
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                if request.num_sent_tokens:
                    self._resume_after_load.add(request_id)

    @property
    def num_loading_requests(self) -> int:
        """Requests waiting for their KV tier loads (the workers must keep reporting)."""
        return len(self._loading)

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, step: _Step) -> None:
        if self.preemption_mode == "swap":
            self.kv_cache_manager.swap_out(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.add_front(request)
        step.preempted_req_ids.add(request.request_id)

    def _free_request(self, request: Request, now: float | None = None) -> None:
        self.kv_cache_manager.free(request)
        if request.structured_output is not None:
            request.structured_output.free()
        request.finished_time = time.monotonic() if now is None else now
        self.requests.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)


class _Step:
    """The requests one :meth:`Scheduler.schedule` call has scheduled so far, in order."""

    __slots__ = (
        "new_blocks",
        "num_scheduled_tokens",
        "preempted_req_ids",
        "requests",
        "resumed",
        "total_num_scheduled_tokens",
    )

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.new_blocks: list[KVCacheBlocks | None] = []
        self.resumed: list[bool] = []
        self.num_scheduled_tokens: dict[str, int] = {}
        self.total_num_scheduled_tokens = 0
        self.preempted_req_ids: set[str] = set()

    def add(
        self,
        request: Request,
        num_new_tokens: int,
        new_blocks: KVCacheBlocks | None,
        resumed: bool,
    ) -> None:
        self.requests.append(request)
        self.new_blocks.append(new_blocks)
        self.resumed.append(resumed)
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.total_num_scheduled_tokens += num_new_tokens

    def unschedule(self, request: Request) -> int:
        """Take ``request`` out of the step (a preemption victim); its tokens, 0 if absent."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, 0)
        if num_tokens:
            index = self.requests.index(request)
            del self.requests[index], self.new_blocks[index], self.resumed[index]
            self.total_num_scheduled_tokens -= num_tokens
        return num_tokens
