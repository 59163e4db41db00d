"""LLMEngine: the step loop tying the scheduler, the KV cache, the model runner and detokenization.

One :meth:`LLMEngine.step`::

    scheduler.schedule()            which requests compute how many tokens; KV blocks allocated
    runner.execute_model(...)       one forward over the flattened batch; sample at last rows
    scheduler.update_from_output()  append tokens; EOS / stop token / max_tokens finish requests
    _process_outputs(...)           detokenize incrementally, check stop strings, build outputs

Offline use goes through :class:`pagedkv.engine.llm.LLM`; the server drives ``add_request`` /
``step`` / ``abort_request`` from its own loop and streams each step's deltas.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.core.config import KVCacheConfig
from pagedkv.core.events import KVCacheEvent
from pagedkv.core.manager import KVCacheManager
from pagedkv.core.spec import FullAttentionSpec
from pagedkv.engine.config import (
    DEFAULT_MAX_KV_CACHE_MEMORY,
    DEFAULT_MAX_MODEL_LEN_CAP,
    EngineConfig,
)
from pagedkv.engine.cpu_runtime import tune_cpu_runtime
from pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.stats import SchedulerStats
from pagedkv.errors import InvalidRequestError

#: A prompt: text, token ids, or chat messages ``[{"role": ..., "content": ...}, ...]``.
Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


@dataclass(slots=True)
class EngineStats:
    """Engine counters: the scheduler's plus request and timing totals.

    Attributes:
        scheduler: the scheduler's snapshot (KV usage, peak, preemptions, prefix-cache hits...).
        num_requests: requests added (each of n samples counts once: prompts, not sequences).
        num_finished_requests: requests whose every sample finished.
        num_steps: step() calls that ran the model.
        busy_time: seconds spent inside step() calls that ran the model.
    """

    scheduler: SchedulerStats
    num_requests: int = 0
    num_finished_requests: int = 0
    num_steps: int = 0
    busy_time: float = 0.0


@dataclass(slots=True, eq=False)
class _Sample:
    """Output state of one sequence (one of the n samples of a request)."""

    request: Request
    detokenizer: Any
    text: str = ""
    num_emitted_tokens: int = 0  # output tokens already reported
    num_emitted_chars: int = 0  # characters of text already reported
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True, eq=False)
class _RequestState:
    """Everything the engine keeps about one add_request call until it finishes."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    max_stop_len: int = 0
    num_unfinished: int = 0
    changed: bool = False
    outputs: list[CompletionOutput] = field(default_factory=list)


class LLMEngine:
    """Continuous-batching inference engine over the paged KV cache.

    Args:
        config: the engine's options (see :class:`EngineConfig`); keyword arguments override
            its fields, e.g. ``LLMEngine(dtype="float32", num_blocks=512)``.
        loaded_model: an already loaded :class:`pagedkv.model.loader.LoadedModel` to reuse
            (tests share one between engines); its dtype wins over ``config.dtype``.

    Raises:
        ConfigError / CacheSizingError: invalid options, or a KV cache that cannot hold one
            request of max_model_len.
        ModelLoadError: the model cannot be found or read.
    """

    def __init__(
        self, config: EngineConfig | None = None, *, loaded_model=None, **overrides: Any
    ) -> None:
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = EngineConfig(**{**_fields(config), **overrides})
        self.config = config
        tune_cpu_runtime(config.num_threads)
        if loaded_model is None:
            from pagedkv.model.loader import load_model

            loaded_model = load_model(config.model, dtype=getattr(torch, config.dtype))
        self.loaded_model = loaded_model
        model_config = loaded_model.config
        self.model_config = model_config
        self.tokenizer = loaded_model.tokenizer
        self.eos_token_ids = frozenset(
            tuple(model_config.eos_token_ids) + tuple(self.tokenizer.eos_token_ids)
        )

        max_model_len = config.max_model_len or min(
            model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP
        )
        self.max_model_len = max_model_len
        model = loaded_model.model
        kv_dtype = str(model.dtype).removeprefix("torch.")
        spec = FullAttentionSpec(
            block_size=config.block_size,
            num_kv_heads=model_config.num_key_value_heads,
            head_size=model_config.head_dim,
            dtype=kv_dtype,
        )
        layer_specs = [spec] * model_config.num_hidden_layers
        if config.num_blocks is not None:
            kv_cache_config = KVCacheConfig.from_num_blocks(
                layer_specs,
                config.num_blocks,
                max_model_len=max_model_len,
                max_num_batched_tokens=config.max_num_batched_tokens,
            )
        else:
            kv_cache_memory = config.kv_cache_memory
            if kv_cache_memory is None:
                wanted = (
                    config.max_num_seqs
                    * max_model_len
                    * spec.bytes_per_token
                    * model_config.num_hidden_layers
                )
                kv_cache_memory = min(wanted, DEFAULT_MAX_KV_CACHE_MEMORY)
            kv_cache_config = KVCacheConfig.from_kv_cache_memory(
                layer_specs,
                kv_cache_memory,
                max_model_len=max_model_len,
                max_num_batched_tokens=config.max_num_batched_tokens,
            )
        self.kv_cache_config = kv_cache_config
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config.num_blocks,
            list(kv_cache_config.kv_cache_specs),
            block_size=config.block_size,
            enable_caching=config.enable_prefix_caching,
            hash_algo=config.hash_algo,
            hash_seed=config.hash_seed,
            enable_kv_cache_events=config.enable_kv_cache_events,
            max_model_len=max_model_len,
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.policy,
        )
        from pagedkv.model.runner import ModelRunner

        self.runner = ModelRunner(
            model,
            kv_cache_config,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            seed=config.seed,
        )
        self._states: dict[str, _RequestState] = {}
        self._sample_of: dict[str, tuple[_RequestState, int]] = {}  # sequence id -> state, index
        self._pending: list[_RequestState] = []  # aborted: reported by the next step()
        self._stats = EngineStats(scheduler=SchedulerStats())

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (tokenized as is), token ids, or chat messages (the model's chat
                template is applied, with the assistant's turn opened).
            sampling_params: defaults to ``SamplingParams()``.
            priority: lower = sooner under policy="priority".
            cache_salt: separates this request's prefix-cache entries from others'.
            arrival_time: ``time.monotonic()`` of arrival (default: now).

        Raises:
            InvalidRequestError: sampling_params that are not a SamplingParams, a duplicate id,
                an empty prompt, token ids outside the vocabulary, or a request that can never
                fit (prompt + max_tokens beyond max_model_len, more KV blocks than the pool).
                Nothing is queued then.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        if request_id in self._states:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_token_ids = self._tokenize(prompt)
        vocab_size = self.model_config.vocab_size
        if (
            prompt_token_ids
            and not 0 <= min(prompt_token_ids) <= max(prompt_token_ids) < vocab_size
        ):
            raise InvalidRequestError(
                f"request {request_id!r}: prompt token ids must be in [0, {vocab_size})"
            )
        now = time.monotonic() if arrival_time is None else arrival_time
        state = _RequestState(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=prompt_token_ids,
            params=params,
            samples=[],
            metrics=RequestMetrics(arrival_time=now),
            max_stop_len=max(map(len, params.stop), default=0),
        )
        block_hasher = self.kv_cache_manager.block_hasher
        if not self.config.enable_prefix_caching:
            block_hasher = None
        requests = []
        for index in range(params.n):
            seq_params = params if params.n == 1 else params.for_sample(index)
            requests.append(
                Request(
                    request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                    prompt_token_ids=prompt_token_ids,
                    block_hasher=block_hasher,
                    cache_salt=cache_salt,
                    sampling_params=seq_params,
                    eos_token_ids=self.eos_token_ids,
                    priority=priority,
                    arrival_time=now,
                )
            )
        added = []
        try:
            for request in requests:
                self.scheduler.add_request(request)
                added.append(request)
        except InvalidRequestError:
            self.scheduler.finish_requests(
                [r.request_id for r in added], RequestStatus.FINISHED_ABORTED
            )
            raise
        for index, request in enumerate(requests):
            detokenizer = self.tokenizer.incremental_detokenizer(
                prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
            state.samples.append(_Sample(request=request, detokenizer=detokenizer))
            state.outputs.append(CompletionOutput(index=index))
            self._sample_of[request.request_id] = (state, index)
        state.num_unfinished = params.n
        self._states[request_id] = state
        self._stats.num_requests += 1

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (all their samples): blocks are freed now, and the next :meth:`step`
        reports them once with finish_reason "abort". Unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            state = self._states.get(request_id)
            if state is None or state in self._pending:
                continue
            seq_ids = [s.request.request_id for s in state.samples if s.finish_reason is None]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            for sample in state.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "abort"
                    state.changed = True
            self._pending.append(state)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (e.g. after changing weights). Returns False, changing
        nothing, while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def take_kv_cache_events(self) -> list[KVCacheEvent]:
        """KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared) since the last call;
        always empty unless ``enable_kv_cache_events`` is set. A publisher
        (:mod:`pagedkv.engine.kv_events`) drains them after each step."""
        return self.kv_cache_manager.take_events()

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued, running, or has an output not yet reported."""
        return bool(self._states)

    def get_num_unfinished_requests(self) -> int:
        """Requests (prompts) not yet reported finished."""
        return len(self._states)

    def get_stats(self) -> EngineStats:
        """A snapshot of the counters."""
        stats = self._stats
        return EngineStats(
            scheduler=self.scheduler.get_stats(),
            num_requests=stats.num_requests,
            num_finished_requests=stats.num_finished_requests,
            num_steps=stats.num_steps,
            busy_time=stats.busy_time,
        )

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step and return the outputs of requests that changed.

        Returns:
            One :class:`RequestOutput` per request that got new tokens, finished, or was
            aborted since the last step; finished ones are reported once and then forgotten.

        Raises:
            Whatever the model runner raised. The step's requests are then finished with
            finish_reason "error" (their blocks freed; the next step reports them), so the
            engine stays usable for the other requests.
        """
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        sampled: list[int] = []
        if scheduler_output.total_num_scheduled_tokens:
            try:
                sampled = self.runner.execute_model(scheduler_output)
            except Exception:
                self._fail_requests(scheduler_output.requests)
                raise
        changed = self.scheduler.update_from_output(scheduler_output, sampled)
        outputs = self._process_outputs(changed)
        if scheduler_output.total_num_scheduled_tokens:
            self._stats.num_steps += 1
            self._stats.busy_time += time.perf_counter() - start
        return outputs

    def _fail_requests(self, requests: list[Request]) -> None:
        """Finish ``requests`` (and their sibling samples) with finish_reason "error"."""
        for request_id in {self._sample_of[r.request_id][0].request_id for r in requests}:
            state = self._states[request_id]
            seq_ids = [s.request.request_id for s in state.samples if s.finish_reason is None]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ERROR)
            for sample in state.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "error"
                    state.changed = True
            if state not in self._pending:
                self._pending.append(state)

    def _process_outputs(self, changed: list[Request]) -> list[RequestOutput]:
        touched: list[_RequestState] = self._pending
        self._pending = []
        for request in changed:
            state, index = self._sample_of[request.request_id]
            sample = state.samples[index]
            if sample.finish_reason is not None:
                continue
            self._detokenize(state, sample)
            if sample.finish_reason is None and request.is_finished:
                sample.finish_reason = request.finish_reason
                sample.stop_reason = request.stop_reason
            if not state.changed:
                state.changed = True
                touched.append(state)
        results = []
        finished_seq_ids = []
        for state in touched:
            state.changed = False
            output = self._make_output(state)
            results.append(output)
            if output.finished:
                del self._states[state.request_id]
                for sample in state.samples:
                    del self._sample_of[sample.request.request_id]
                    finished_seq_ids.append(sample.request.request_id)
                self._stats.num_finished_requests += 1
        if finished_seq_ids:
            self.runner.finish_requests(finished_seq_ids)
        return results

    def _detokenize(self, state: _RequestState, sample: _Sample) -> None:
        """Decode the sample's new tokens and stop it at the first stop string."""
        request = sample.request
        new_token_ids = request.all_token_ids[
            request.num_prompt_tokens + sample.num_emitted_tokens :
        ]
        if not new_token_ids:
            return
        start = max(0, len(sample.text) - state.max_stop_len + 1)
        sample.text += sample.detokenizer.step(new_token_ids)
        if request.first_token_time is not None and state.metrics.first_token_time is None:
            state.metrics.first_token_time = request.first_token_time
        if state.max_stop_len:
            self._check_stop_strings(state, sample, start)

    def _check_stop_strings(self, state: _RequestState, sample: _Sample, start: int) -> None:
        params = state.params
        for stop in params.stop:
            pos = sample.text.find(stop, start)
            if pos < 0:
                continue
            end = pos + len(stop) if params.include_stop_str_in_output else pos
            sample.text = sample.text[:end]
            sample.finish_reason = "stop"
            sample.stop_reason = stop
            self.scheduler.finish_requests(
                sample.request.request_id, RequestStatus.FINISHED_STOPPED
            )
            return

    def _make_output(self, state: _RequestState) -> RequestOutput:
        outputs = []
        finished = True
        for index, sample in enumerate(state.samples):
            request = sample.request
            token_ids = request.output_token_ids
            text = sample.text
            visible = len(text)
            if sample.finish_reason is None:
                finished = False
                if state.max_stop_len:
                    # Hold back an end of the text that may be the start of a stop string.
                    visible -= _partial_stop_len(text, state.params.stop)
                    visible = max(visible, sample.num_emitted_chars)
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=text[:visible],
                    token_ids=token_ids,
                    new_text=text[sample.num_emitted_chars : visible],
                    new_token_ids=token_ids[sample.num_emitted_tokens :],
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    error=request.error,
                )
            )
            sample.num_emitted_chars = visible
            sample.num_emitted_tokens = len(token_ids)
        first = state.samples[0].request
        metrics = state.metrics
        metrics.first_scheduled_time = first.first_scheduled_time
        if finished:
            metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=dataclasses.replace(metrics),
        )

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            text = self.tokenizer.apply_chat_template(items, tokenize=False)
            return text, self.tokenizer.apply_chat_template(items)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise InvalidRequestError(
                "a prompt must be a str, a list of token ids, or a list of chat messages "
                "({'role': ..., 'content': ...})"
            )
        return None, items


def _fields(config: EngineConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper start of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
