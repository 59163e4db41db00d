"""LLMEngine: the step loop tying the scheduler, the KV cache, the model runner and the outputs.

One :meth:`LLMEngine.step`::

    scheduler.schedule()            which requests compute how many tokens; KV blocks allocated
    runner.execute_model(...)       one forward over the flattened batch; sample at last rows
    scheduler.update_from_output()  append tokens; EOS / stop token / max_tokens finish requests
    output_processor.process_outputs(...)
                                    detokenize incrementally, check stop strings, build outputs

Offline use goes through :class:`pagedkv.engine.llm.LLM`; the server drives ``add_request`` /
``step`` / ``abort_request`` from its own loop and streams each step's deltas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.core.events import KVCacheEvent
from pagedkv.core.kv_view import snapshot_kv_cache
from pagedkv.core.manager import KVCacheManager
from pagedkv.engine.beam_search import BeamSearchGroup, num_beam_candidates
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.config_resolution import resolve_engine_config
from pagedkv.engine.cpu_runtime import tune_cpu_runtime
from pagedkv.engine.input_processor import InputProcessor, Prompt
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.sample_forks import fork_samples, sample_ids
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.stats import KVTierStats, SchedulerStats
from pagedkv.engine.structured_output import StructuredOutputManager, StructuredOutputRequest
from pagedkv.errors import InvalidRequestError
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import BeamSearchParams, SamplingParams
from pagedkv.worker.executor import create_executor
from pagedkv.worker.outputs import ModelRunnerOutput
from pagedkv.worker.scheduler_output import NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

#: Longest a step with nothing to run waits for a grammar compile (then it returns).
_COMPILE_WAIT_S = 0.05


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector disabled inside the block (for the whole process:
    ``gc.disable``), enabled again after it, whatever it raises, where it was enabled before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(slots=True)
class EngineStats:
    """Engine counters: the scheduler's plus request and timing totals.

    Attributes:
        scheduler: the scheduler's snapshot (KV usage, peak, preemptions, prefix-cache hits...).
        num_requests: requests added (each of n samples counts once: prompts, not sequences).
        num_finished_requests: requests whose every sample finished.
        num_steps: step() calls that ran the model.
        busy_time: seconds spent inside step() calls that ran the model.
        kv_tier: the KV tier's counters (None without a tier).
    """

    scheduler: SchedulerStats
    num_requests: int = 0
    num_finished_requests: int = 0
    num_steps: int = 0
    busy_time: float = 0.0
    kv_tier: KVTierStats | None = None


class LLMEngine:
    """Continuous-batching inference engine over the paged KV cache.

    Args:
        config: the engine's options (see :class:`EngineConfig`); keyword arguments override
            its fields, e.g. ``LLMEngine(dtype="float32", num_blocks=512)``. They are resolved
            once (:func:`~pagedkv.engine.config_resolution.resolve_engine_config`) into the
            frozen ``engine.config``; ``engine.options`` keeps them as given.
        loaded_model: an already loaded :class:`pagedkv.model.loader.LoadedModel` to reuse
            (tests share one between engines); its dtype wins over ``config.dtype`` (and
            becomes the engine's ``config.model_config.dtype``). Not with
            ``tensor_parallel_size`` > 1 (each rank loads its shard: see model_loader).
        model_loader: with ``tensor_parallel_size`` > 1, a picklable
            ``model_loader(parallel=...)`` that each rank calls to load its shard (default:
            :func:`pagedkv.model.loader.load_model` of ``config.model`` in ``config.dtype``).
        draft_model: speculative decoding's draft model, already loaded (tests; the target
            itself drafting for itself), for a ``speculative_config`` of method
            "draft_model"; None: its ``model`` is loaded.

    Python's cyclic garbage collector is paused for the whole process while the engine is
    built (:func:`gc_paused`), and enabled again after, where it was enabled.

    Raises:
        ConfigError / CacheSizingError: invalid options, a max_model_len beyond the model's
            context, or a KV cache that cannot hold one request of max_model_len
            (:func:`pagedkv.engine.kv_sizing.size_kv_cache`); raised from the model's header,
            before its weights load.
        ModelLoadError: the model cannot be found or read.
        WorkerError: a tensor-parallel rank failed to start.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        loaded_model=None,
        model_loader=None,
        draft_model=None,
        **overrides: Any,
    ) -> None:
        # Python's cyclic garbage collector paused while the engine is built: the start-up
        # allocates hundreds of thousands of objects that all stay (the tokenizer thread's
        # transformers import, the model's modules), so on a GGUF file's first start its
        # 135-odd collections (one of the oldest generation) found almost nothing and held the
        # GIL 0.27 s that both of the start's threads (weights, tokenizer) wait on; paused, 3
        # remain (0.06-0.08 s, one when the pause ends). A later start's collections are
        # cheaper (0.05 s) and the pause saves about nothing there. vLLM freezes its start-up
        # heap for the same reason.
        with gc_paused():
            self._build(
                config,
                loaded_model=loaded_model,
                model_loader=model_loader,
                draft_model=draft_model,
                **overrides,
            )

    def _build(
        self,
        config: EngineConfig | None,
        *,
        loaded_model,
        model_loader,
        draft_model,
        **overrides: Any,
    ) -> None:
        """:meth:`__init__`'s work."""
        self._tier_saved = False  # shutdown() paged the prefix cache out to a disk tier
        if config is None:
            config = EngineConfig(**overrides)
        else:  # a copy: the caller's object may change later, what was typed may not
            config = dataclasses.replace(config, **overrides)
        # Every setting decided once, before the weights load (seconds), then frozen.
        resolved = resolve_engine_config(
            config, loaded_model=loaded_model, model_loader=model_loader, draft_model=draft_model
        )
        #: the options as given (keyword overrides applied; "auto" and None left as typed).
        self.options = resolved.options
        #: the dtype asked for ("auto" by default); ``config.model_config.dtype`` runs.
        self.requested_dtype = config.dtype
        #: what this CPU computes fast (:mod:`pagedkv.cpu_caps`); decided dtype "auto".
        self.cpu_capabilities = resolved.cpu_capabilities
        #: the resolved, frozen config (vLLM's VllmConfig; :mod:`pagedkv.engine.
        #: config_resolution`): the one home of every setting (``cache_config.block_size``...).
        self.config = self.pagedkv_config = resolved.config
        #: the attention backend (owns the KV cache's layout and runs attention).
        self.attention_backend = resolved.attention.backend
        #: why the backend asked for (or auto's first choice) was passed over; None if it runs.
        self.attention_backend_fallback_reason = resolved.attention.fallback_reason
        #: the KV cache's blocks, groups and specs (their block size: the config's).
        self.kv_cache_config = kv_cache_config = resolved.kv_cache_config
        self.max_model_len = self.config.model_config.max_model_len
        self.kv_cache_manager = KVCacheManager.from_config(
            kv_cache_config, self.config.cache_config
        )
        self.scheduler = Scheduler.from_config(
            self.kv_cache_manager,
            self.config.scheduler_config,
            self.config.speculative_config,
        )
        if self.config.speculative_config is not None:  # the workers propose the drafts
            logger.info("%s", self.config.speculative_config.summary())
        #: runs the steps: one process, or tensor-parallel ranks (:mod:`pagedkv.worker.executor`).
        self.executor = create_executor(
            self.config,
            kv_cache_config,
            self.attention_backend,
            loaded_model=resolved.loaded_model,
            model_loader=model_loader,
            runtime_setup=functools.partial(
                tune_cpu_runtime, self.config.parallel_config.num_threads
            ),
            draft_model=draft_model,
        )
        #: rank 0's model runner (its persistent batch, KV cache and sampler).
        self.runner = self.executor.runner
        if self.scheduler.drafts is not None:  # verification steps on the decode steps' bits
            self.scheduler.drafts.set_max_step_tokens(self.runner.max_row_exact_tokens)
        if resolved.tier_keys:  # a disk tier's entries from an earlier run
            for key in self.kv_cache_manager.offloader.restore(resolved.tier_keys):
                self.runner.kv_tier.drop(key, 0)
            logger.info("KV tier: %d entries found", len(self.kv_cache_manager.offloader))
        self._build_processors()
        self._stats = EngineStats(scheduler=SchedulerStats())
        self._last_scheduler_output: SchedulerOutput | None = None
        #: The clock of :meth:`step`'s timing (seconds; ``time.perf_counter``): the busy time
        #: in the stats and the step costs the draft-length rule learns. Tests script it.
        self.step_clock = time.perf_counter

    # ------------------------------------------------------------------ building steps

    def _build_processors(self) -> None:
        """The tokenizer's side: end-of-sequence ids, outputs, structured outputs, inputs."""
        self.loaded_model = self.executor.loaded_model
        self.model_config = self.loaded_model.config
        self.tokenizer = self.loaded_model.tokenizer
        # An end-of-sequence id beyond the model's vocabulary can never be sampled (nor masked).
        vocab_size = self.model_config.vocab_size
        self.eos_token_ids = frozenset(
            t
            for t in (*self.model_config.eos_token_ids, *self.tokenizer.eos_token_ids)
            if 0 <= t < vocab_size
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        #: structured outputs: constraints parsed and compiled (off the step thread), the
        #: per-step bitmask (:mod:`pagedkv.engine.structured_output`).
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer,
            vocab_size=vocab_size,
            eos_token_ids=self.eos_token_ids,
            max_threads=max(1, torch.get_num_threads()),
        )
        self._has_structured_outputs = False  # True from the first constrained request on
        #: prompts -> validated token ids, parameters checked against the model and the limits
        #: (used in the caller's thread; a server runs a copy on its own input thread).
        self.input_processor = InputProcessor(
            self.tokenizer,
            vocab_size=vocab_size,
            max_model_len=self.max_model_len,
            max_logprobs=self.config.model_config.max_logprobs,
            policy=self.config.scheduler_config.policy,
            structured_outputs=self.structured_output_manager,
        )

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); idempotent, and a no-op in
        one process. Also run at garbage collection and at interpreter exit. With a disk KV tier,
        first pages the prefix cache's blocks out to it (so a restart finds them) and waits for
        its writes."""
        if (
            self.config.cache_config.kv_offloading_backend == "disk"
            and not self._tier_saved
            and self.kv_cache_manager.page_out_cached()
        ):
            ops = self.kv_cache_manager.take_tier_ops()
            ops.wait_for_writes = True  # the last page-out waits for the disk, not dropped
            self.executor.execute_model(SchedulerOutput(kv_tier_ops=ops))
        self._tier_saved = True
        self.executor.shutdown()
        self.structured_output_manager.shutdown()

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (tokenized as is), token ids, ``{"prompt": text}``,
                ``{"prompt_token_ids": ids}`` (optionally with ``"prompt": text``, then only
                reported as ``RequestOutput.prompt``), or chat messages (the model's chat
                template is applied, with the assistant's turn opened).
            sampling_params: defaults to ``SamplingParams()``. A :class:`BeamSearchParams`
                makes it a beam search: it streams nothing, and :meth:`step` reports it once,
                finished, with ``beam_width`` outputs best first (token ids, text,
                ``cumulative_logprob``, per-token logprobs, finish and stop reasons;
                :func:`pagedkv.engine.beam_search.beam_search_output` turns that output into
                vLLM's ``BeamSearchOutput``); abort it like any request. A
                :class:`~pagedkv.pooling_params.PoolingParams` makes it a pooling (embedding)
                request: its prompt is prefilled, no token is sampled, and :meth:`step`
                reports it once, finished, with ``RequestOutput.embedding`` (vLLM's
                ``LLMEngine.add_request`` takes pooling params in the same place).
            priority: lower = sooner under policy="priority".
            cache_salt: separates this request's prefix-cache entries from others'.
            arrival_time: ``time.monotonic()`` of arrival (default: now).

        Raises:
            InvalidRequestError: sampling_params that are not a SamplingParams, a duplicate id,
                an empty prompt, text that is not valid Unicode (a lone surrogate), token ids
                outside the vocabulary (prompt, stop_token_ids, logit_bias), top_k beyond the
                vocabulary, logprobs or prompt_logprobs above ``config.max_logprobs``, a priority
                beyond int64, or a request that can never fit (prompt + max_tokens beyond
                max_model_len, more KV blocks than the pool). Nothing is queued then; the
                error's ``param`` names the field when one is at fault.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        outputs = self.output_processor
        if outputs.has_request(request_id) or outputs.has_sequence(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(params, BeamSearchParams):
            self._add_beam_search(request_id, prompt, params, priority, cache_salt, arrival_time)
            return
        if isinstance(params, PoolingParams):
            self._add_pooling(request_id, prompt, params, priority, cache_salt, arrival_time)
            return
        self.input_processor.check_params(params, priority)
        processed = self.input_processor.process(prompt)
        prompt_text, prompt_token_ids = processed.text, processed.token_ids
        params = self.input_processor.resolve_max_tokens(params, len(prompt_token_ids))
        constraint = params.structured_outputs
        grammar = None
        if constraint is not None:  # parsed here (cached), compiled on the grammar thread
            grammar = self.structured_output_manager.request(constraint)
            self._has_structured_outputs = True
        now = time.monotonic() if arrival_time is None else arrival_time
        num_samples = params.num_samples
        requests = [
            self._make_request(
                seq_id,
                params if num_samples == 1 else params.for_sample(index),
                prompt_token_ids=prompt_token_ids,
                cache_salt=cache_salt,
                priority=priority,
                arrival_time=now,
                structured_output=None if grammar is None else StructuredOutputRequest(grammar),
            )
            for index, seq_id in enumerate(sample_ids(request_id, num_samples))
        ]
        for request in requests:  # a sample aborted but not reported yet keeps its id
            if outputs.has_sequence(request.request_id):
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        added = []
        try:
            for request in fork_samples(requests):  # n > 1: one prefill, then forks
                self.scheduler.add_request(request)
                added.append(request)
        except InvalidRequestError:
            self.scheduler.finish_requests(
                [r.request_id for r in added], RequestStatus.FINISHED_ABORTED
            )
            raise
        self.output_processor.add_request(
            request_id, prompt_text, prompt_token_ids, params, requests, now
        )
        self._stats.num_requests += 1

    def _add_pooling(
        self,
        request_id: str,
        prompt: Prompt,
        params: PoolingParams,
        priority: int,
        cache_salt: str | None,
        arrival_time: float | None,
    ) -> None:
        """Queue a pooling request: one sequence whose prompt may fill max_model_len (nothing
        is generated); mean and cls pooling skip the prefix-cache lookup (Request)."""
        sampling_params = SamplingParams(temperature=0.0, max_tokens=1)  # unused: no sampling
        self.input_processor.check_params(sampling_params, priority)
        processed = self.input_processor.process(prompt)
        now = time.monotonic() if arrival_time is None else arrival_time
        request = self._make_request(
            request_id,
            sampling_params,
            prompt_token_ids=processed.token_ids,
            cache_salt=cache_salt,
            priority=priority,
            arrival_time=now,
            pooling_params=params,
        )
        self.scheduler.add_request(request)
        self.output_processor.add_request(
            request_id, processed.text, processed.token_ids, sampling_params, [request], now
        )
        self._stats.num_requests += 1

    def _add_beam_search(
        self,
        request_id: str,
        prompt: Prompt,
        params: BeamSearchParams,
        priority: int,
        cache_salt: str | None,
        arrival_time: float | None,
    ) -> None:
        """Queue a beam search: its first beam (the prompt), which the scheduler forks into
        ``beam_width`` beams after the first token (:mod:`pagedkv.engine.beam_search`)."""
        self.input_processor.check_params(params, priority)
        if self.scheduler.spec_decode_enabled:  # vLLM refuses the pair too
            raise InvalidRequestError(
                "use_beam_search: beam search cannot run with speculative decoding (the "
                "engine's speculative_config); use an engine without it",
                param="use_beam_search",
            )
        vocab_size = self.model_config.vocab_size
        num_eos = 0 if params.ignore_eos else len(self.eos_token_ids)
        if num_beam_candidates(params.beam_width, num_eos) > vocab_size:
            raise InvalidRequestError(
                f"beam_width ({params.beam_width}) is too large for the vocabulary "
                f"({vocab_size} tokens): each step ranks "
                f"{num_beam_candidates(params.beam_width, num_eos)} candidates",
                param="beam_width",
            )
        processed = self.input_processor.process(prompt)
        prompt_token_ids = processed.token_ids
        params = self.input_processor.resolve_max_tokens(params, len(prompt_token_ids))
        now = time.monotonic() if arrival_time is None else arrival_time
        make_root = functools.partial(
            self._make_request,
            prompt_token_ids=prompt_token_ids,
            cache_salt=cache_salt,
            priority=priority,
            arrival_time=now,
        )
        group = BeamSearchGroup(request_id, params, self.eos_token_ids, make_root)
        self.scheduler.add_request(group.root)
        self.output_processor.add_beam_search_request(
            request_id, processed.text, prompt_token_ids, group, now
        )
        self._stats.num_requests += 1

    def _make_request(
        self,
        request_id: str,
        sampling_params: SamplingParams,
        *,
        prompt_token_ids: list[int],
        cache_salt: str | None,
        priority: int,
        arrival_time: float,
        structured_output: StructuredOutputRequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> Request:
        """The one place a client's sequence becomes a :class:`Request`: the engine's block
        hasher (none without prefix caching) and end-of-sequence ids."""
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            block_hasher=(
                self.kv_cache_manager.block_hasher
                if self.config.cache_config.enable_prefix_caching
                else None
            ),
            cache_salt=cache_salt,
            sampling_params=sampling_params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            arrival_time=arrival_time,
            structured_output=structured_output,
            pooling_params=pooling_params,
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (all their samples): blocks are freed now, and the next :meth:`step`
        reports them once with finish_reason "abort". Unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            seq_ids = self.output_processor.finish_request(request_id, "abort")
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (e.g. after changing weights), the KV tier's entries
        included: a disk tier's files are deleted before this returns (a restart must not
        adopt KV the reset declared stale). Returns False, changing nothing, while any request
        holds blocks (a request waiting for its tier loads included)."""
        manager = self.kv_cache_manager
        if not manager.reset_prefix_cache():
            return False
        ops = manager.take_tier_ops()
        if ops:
            ops.wait_for_writes = True
            self.executor.execute_model(SchedulerOutput(kv_tier_ops=ops))
        return True

    def take_kv_cache_events(self) -> list[KVCacheEvent]:
        """KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared) since the last call;
        always empty unless ``enable_kv_cache_events`` is set. A publisher
        (:mod:`pagedkv.cluster.kv_events`) drains them after each step."""
        return self.kv_cache_manager.take_events()

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued, running, or has an output not yet reported."""
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Requests (prompts) not yet reported finished."""
        return self.output_processor.get_num_unfinished_requests()

    def get_stats(self) -> EngineStats:
        """A snapshot of the counters."""
        stats = self._stats
        return EngineStats(
            scheduler=self.scheduler.get_stats(),
            num_requests=stats.num_requests,
            num_finished_requests=stats.num_finished_requests,
            num_steps=stats.num_steps,
            busy_time=stats.busy_time,
            kv_tier=self._kv_tier_stats(),
        )

    def kv_snapshot(self) -> dict[str, Any]:
        """The KV cache, the block tables of the running, loading and waiting requests, the
        last step's batch and the scheduler's counters, as plain data
        (:func:`pagedkv.core.kv_view.snapshot_kv_cache`; no block hash, no token id). Call it
        between steps (the server's engine thread does, only while a /kv page listens)."""
        scheduler = self.scheduler
        last = self._last_scheduler_output
        requests = scheduler.request_states()
        stats = dataclasses.asdict(scheduler.get_stats())
        stats["prefix_cache_hit_rate"] = scheduler.stats.prefix_cache_hit_rate
        return snapshot_kv_cache(
            self.kv_cache_manager,
            requests,
            num_scheduled_tokens=None if last is None else last.num_scheduled_tokens,
            blocks_to_copy=() if last is None else last.blocks_to_copy,
            stats=stats,
        )

    def _kv_tier_stats(self) -> KVTierStats | None:
        offloader = self.kv_cache_manager.offloader
        if offloader is None:
            return None
        counts, io = offloader.stats, self.runner.kv_tier.stats
        return KVTierStats(
            medium=offloader.medium,
            num_blocks=offloader.num_blocks,
            num_used_blocks=len(offloader),
            num_hit_blocks=counts.num_loaded_blocks,
            num_stored_blocks=counts.num_stored_blocks,
            num_evicted_blocks=counts.num_evicted_blocks,
            num_failed_loads=io.num_failed_loads,
            bytes_stored=io.bytes_stored,
            bytes_loaded=io.bytes_loaded,
            load_seconds=io.load_seconds,
            num_dropped_stores=io.num_dropped_stores,
        )

    def check_health(self) -> None:
        """Run the model on a one-token probe request alone, outside the scheduler (no client
        request in the batch; its block is taken from and given back to the pool). The server
        calls it after a step failed: if the probe fails too, the fault is the engine's (a
        broken model, out of memory), not the step's requests'.

        Raises:
            whatever the model runner raises. Returns without running the model when no KV
            block is free (inconclusive).
        """
        probe = Request(
            request_id=f"pagedkv-probe-{id(self)}",
            prompt_token_ids=[0],
            sampling_params=SamplingParams(temperature=0, max_tokens=1),
        )
        manager = self.kv_cache_manager
        if manager.allocate_slots(probe, 1) is None:
            return
        probe_id = probe.request_id
        try:
            self.executor.execute_model(
                SchedulerOutput(
                    scheduled_new_reqs=[
                        NewRequestData(
                            probe_id,
                            [0],
                            probe.sampling_params,
                            manager.get_block_ids(probe_id),
                            0,
                        )
                    ],
                    num_scheduled_tokens={probe_id: 1},
                    total_num_scheduled_tokens=1,
                    kv_tier_ops=manager.take_tier_ops(),  # its block may have paged one out
                )
            )
        finally:
            manager.free(probe)
            # The workers forget the probe with the next step's finished requests.
            self.scheduler.note_finished((probe_id,))

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step and return the outputs of requests that changed.

        Returns:
            One :class:`RequestOutput` per request that got new tokens, finished, or was
            aborted since the last step; finished ones are reported once and then forgotten.

        Raises:
            Whatever the model runner, or the processing of its output, raised. The step's
            requests are then finished with finish_reason "error" (their blocks freed; the next
            step reports them), so the engine stays usable for the other requests.
        """
        start = self.step_clock()
        scheduler_output = self.scheduler.schedule()
        self._last_scheduler_output = scheduler_output  # for kv_snapshot: the last batch
        if self._has_structured_outputs:
            manager = self.structured_output_manager
            if scheduler_output.total_num_scheduled_tokens:
                manager.fill_bitmask(scheduler_output, self.scheduler.scheduled_requests)
            elif self.scheduler.has_unfinished_requests():
                # Only requests waiting for their grammar: wait for one (not a busy loop).
                manager.wait_for_compiles(_COMPILE_WAIT_S)
        runner_output = ModelRunnerOutput()
        if (
            scheduler_output.total_num_scheduled_tokens
            or scheduler_output.kv_tier_ops
            or self.scheduler.num_loading
        ):
            # (KV tier instructions, or loads in flight to report, run with no token too)
            try:
                runner_output = self.executor.execute_model(scheduler_output)
            except BaseException as exc:
                # The workers may not have applied the output (even a Ctrl-C inside it): tell
                # them again next step, so no finished request's state stays behind.
                self.scheduler.note_finished(scheduler_output.finished_req_ids)
                if isinstance(exc, Exception):
                    self._fail_requests(scheduler_output.req_ids, exc)
                raise
        else:  # nothing to run: the workers forget finished requests with the next real step
            self.scheduler.note_finished(scheduler_output.finished_req_ids)
        try:
            changed = self.scheduler.update_from_output(scheduler_output, runner_output)
            outputs = self._process_outputs(changed, runner_output)
        except Exception as exc:
            # A fault after the model ran (a stop check, a beam search's choice, detokenizing):
            # the step's requests fail with it (their blocks freed; the next step reports them)
            # instead of waiting forever, and the engine goes on with the others.
            self._fail_requests(scheduler_output.req_ids, exc)
            raise
        if scheduler_output.total_num_scheduled_tokens:
            elapsed = self.step_clock() - start
            self.scheduler.record_step_time(elapsed)  # the draft-length rule's step costs
            self._stats.num_steps += 1
            self._stats.busy_time += elapsed
        return outputs

    def _fail_requests(self, seq_ids: list[str], exc: BaseException) -> None:
        """Finish the sequences ``seq_ids`` (and their sibling samples) with finish_reason
        "error"; each output's ``error`` says what ``exc`` was."""
        message = f"{type(exc).__name__}: {exc}"
        get_request = self.scheduler.get_request
        groups = {}
        for seq_id in seq_ids:
            request = get_request(seq_id)
            if request is not None and request.beam_group is not None:
                groups[seq_id] = request.beam_group.request_id
        request_ids = self.output_processor.request_ids_of(s for s in seq_ids if s not in groups)
        request_ids |= set(groups.values())
        for request_id in request_ids:
            seq_ids = self.output_processor.finish_request(request_id, "error", error=message)
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ERROR)

    def _process_outputs(
        self, changed: list[Request], runner_output: ModelRunnerOutput | None = None
    ) -> list[RequestOutput]:
        """Build the step's outputs; stop sequences that hit a stop string (the workers forget
        finished sequences with the next step's ``finished_req_ids``)."""
        result = self.output_processor.process_outputs(changed, runner_output)
        if result.seq_ids_to_stop:
            self.scheduler.finish_requests(result.seq_ids_to_stop, RequestStatus.FINISHED_STOPPED)
        self._stats.num_finished_requests += sum(o.finished for o in result.request_outputs)
        return result.request_outputs
