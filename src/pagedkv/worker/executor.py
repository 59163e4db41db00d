"""Executor: what the engine calls to run a step, in one process or over tensor-parallel ranks.

The engine builds one with :func:`create_executor` and knows nothing else of how the model runs
(vLLM V1's ``Executor.get_class``): it hands each plain
:class:`~pagedkv.worker.scheduler_output.SchedulerOutput` to :meth:`Executor.execute_model` and
gets a :class:`~pagedkv.worker.outputs.ModelRunnerOutput` back.

- :class:`UniProcExecutor`: one :class:`~pagedkv.worker.model_runner.ModelRunner` in the engine's
  process (``tensor_parallel_size`` 1).
- :class:`~pagedkv.worker.tp_executor.TensorParallelExecutor`: rank 0 in the engine's process,
  ranks 1 .. N-1 as worker processes, each with its shard and its own persistent batch.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from pagedkv.config import PagedKVConfig
from pagedkv.core.config import KVCacheConfig
from pagedkv.errors import ConfigError
from pagedkv.model.loader import LoadedModel, load_model
from pagedkv.ops.backends import AttentionBackend
from pagedkv.worker.kv_offload import CpuKVTier, DiskKVTier, KVTier
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.outputs import ModelRunnerOutput
from pagedkv.worker.scheduler_output import SchedulerOutput


class Executor(ABC):
    """Runs the engine's steps.

    Attributes:
        loaded_model: the model rank 0 runs (its config and tokenizer serve the engine).
        runner: rank 0's model runner (its persistent batch and KV cache, for inspection).
    """

    loaded_model: LoadedModel
    runner: ModelRunner

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step to every rank's batch, run the forward, return rank 0's samples."""

    def shutdown(self) -> None:  # noqa: B027  (nothing to stop in one process)
        """Stop whatever the executor started; idempotent."""


class UniProcExecutor(Executor):
    """One model runner in this process.

    Args:
        loaded_model: the model to run (its ``max_positions`` is extended to
            ``max_model_len`` when a longer one was allowed).
        kv_cache_config: the KV cache's blocks and groups.
        config: the engine's resolved config.
        attention_backend: the attention backend that owns the caches.
        draft_model: speculative decoding's draft model (its layers follow the model's in
            ``kv_cache_config``), or None.

    Raises:
        ConfigError: a draft model whose tokenizer is not the model's.
    """

    def __init__(
        self,
        loaded_model: LoadedModel,
        kv_cache_config: KVCacheConfig,
        config: PagedKVConfig,
        attention_backend: AttentionBackend | str | None,
        draft_model: LoadedModel | None = None,
    ) -> None:
        model = loaded_model.model
        max_model_len = config.scheduler_config.max_model_len
        for m in (loaded_model, draft_model):
            if m is not None and max_model_len > m.model.max_positions:
                m.model.extend_positions(max_model_len)  # allowed by allow_long_max_model_len
        if draft_model is not None:
            check_same_tokenizer(loaded_model, draft_model)
        self.loaded_model = loaded_model
        self.draft_model = draft_model
        self.runner = ModelRunner(
            model,
            kv_cache_config,
            config.scheduler_config,
            seed=config.model_config.seed,
            attention_backend=attention_backend,
            kv_cache_dtype=config.cache_config.cache_dtype,
            kv_tier=make_kv_tier(config, kv_cache_config),
            speculative_config=config.speculative_config,
            draft_model=None if draft_model is None else draft_model.model,
            batch_invariant=config.model_config.batch_invariant,
        )

    def shutdown(self) -> None:
        if self.runner.kv_tier is not None:
            self.runner.kv_tier.close()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft model whose token ids mean other text than the target's.

    Raises:
        ConfigError: the vocabularies (token -> id, added tokens included) differ.
    """
    if draft.tokenizer is target.tokenizer:
        return
    size, draft_size = target.tokenizer.vocab_size, draft.tokenizer.vocab_size
    if size == draft_size:
        ids = list(range(size))
        differ = sum(
            a != b
            for a, b in zip(
                target.tokenizer.decode_tokens(ids), draft.tokenizer.decode_tokens(ids), strict=True
            )
        )
        if not differ:
            return
        why = f"{differ} of its {size} token ids are other text"
    else:
        why = f"{draft_size} tokens vs {size}"
    raise ConfigError(
        f"speculative_config: the draft model {draft.source} does not share the tokenizer of "
        f"{target.source} ({why}): its drafts would be other tokens"
    )


def make_kv_tier(config: PagedKVConfig, kv_cache_config: KVCacheConfig) -> KVTier | None:
    """The KV tier's data store of ``config.cache_config`` (None when off): each entry one
    pool block's bytes (``kv_cache_config.bytes_per_block``)."""
    cache = config.cache_config
    if not cache.kv_offloading_blocks:
        return None
    nbytes = kv_cache_config.bytes_per_block
    if cache.kv_offloading_backend == "disk":
        return DiskKVTier(cache.kv_offloading_dir, cache.kv_offloading_blocks, nbytes)
    return CpuKVTier(cache.kv_offloading_blocks, nbytes)


def create_executor(
    config: PagedKVConfig,
    kv_cache_config: KVCacheConfig,
    attention_backend: AttentionBackend,
    *,
    loaded_model: LoadedModel | None = None,
    model_loader: Callable[..., LoadedModel] | None = None,
    runtime_setup: Callable[[], Any] | None = None,
    draft_model: LoadedModel | None = None,
) -> Executor:
    """The executor for ``config.parallel_config``.

    Args:
        config: the engine's resolved config.
        kv_cache_config: the KV cache's blocks and groups (the same on every rank).
        attention_backend: rank 0's backend (other ranks make their own of the same name).
        loaded_model: a model already loaded (one process only).
        model_loader: a picklable ``model_loader(parallel=...)`` each rank calls for its shard
            (default: :func:`pagedkv.model.loader.load_model` of ``config.model_config.model``
            in its dtype).
        runtime_setup: picklable callable run first in each worker process (threads, malloc).
        draft_model: speculative decoding's draft model, already loaded (one process only);
            None: ``speculative_config.model`` is loaded when the method is "draft_model".

    Raises:
        ModelLoadError: the model (or speculative decoding's draft model) cannot be read.
        ConfigError: a draft model whose tokenizer is not the model's.
        WorkerError: a tensor-parallel rank failed to start.
    """
    model_config = config.model_config
    if model_loader is None:
        model_loader = functools.partial(
            load_model,
            model_config.model,
            dtype=getattr(torch, model_config.dtype),
            quantization=model_config.quantization,
            batch_invariant=model_config.batch_invariant,
        )
    if config.parallel_config.tensor_parallel_size > 1:
        # Lazy: torch.distributed and worker processes only under tensor parallelism.
        from pagedkv.worker.tp_executor import TensorParallelExecutor

        return TensorParallelExecutor(
            model_loader,
            kv_cache_config,
            config,
            attention_backend=attention_backend.name,
            runtime_setup=runtime_setup,
        )
    if loaded_model is None:
        loaded_model = model_loader(parallel=None)
    return UniProcExecutor(
        loaded_model,
        kv_cache_config,
        config,
        attention_backend,
        draft_model or _load_draft_model(config, loaded_model),
    )


def _load_draft_model(config: PagedKVConfig, target: LoadedModel) -> LoadedModel | None:
    """Speculative decoding's draft model (``speculative_config.model``, resolved), or None:
    the target itself when it names the target's file (one copy of the weights; its KV is
    still its own), else loaded in the target's dtype with its file's default quantization."""
    speculative = config.speculative_config
    if speculative is None or not speculative.uses_draft_model:
        return None
    if speculative.model == config.model_config.model:
        return target
    return load_model(
        speculative.model,
        dtype=getattr(torch, config.model_config.dtype),
        quantization=None,
        batch_invariant=config.model_config.batch_invariant,
    )
