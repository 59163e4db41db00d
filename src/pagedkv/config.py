"""The engine's resolved configuration, in small sub-configs with vLLM's field names (torch-free).

:class:`~pagedkv.engine.config.EngineConfig` is what a user writes (one flat set of options, like
vLLM's ``EngineArgs``; ``dtype="auto"``, ``block_size=None`` ...). The engine resolves it once (the
CPU's dtype, the attention backend's block size, the KV cache's size) into a
:class:`PagedKVConfig` (vLLM's ``VllmConfig``): four frozen sub-configs, each handed whole to the
part that needs it, so no component takes a value unpacked by hand or checks it again:

==================  ==============================================  ==========================
sub-config          fields                                          read by
==================  ==============================================  ==========================
ModelRunConfig      model, dtype, max_model_len, seed, max_logprobs   loader, runner, engine
CacheConfig         block_size, num_gpu_blocks, cache_dtype,          KV cache manager, runner
                    enable_prefix_caching, prefix_caching_hash_algo,
                    hash_seed, enable_kv_cache_events
SchedulerConfig     max_num_seqs, max_num_batched_tokens,             scheduler, runner
                    max_model_len, enable_chunked_prefill, policy
ParallelConfig      tensor_parallel_size                              executor factory
==================  ==============================================  ==========================

(vLLM calls the first ``ModelConfig``; here that name is the model's architecture,
:class:`pagedkv.model.config.ModelConfig`.)
"""

from __future__ import annotations

from dataclasses import dataclass

#: Values of ``quantization`` (vLLM's ``--quantization``; :mod:`pagedkv.model.quantization`):
#: "gguf" (a GGUF file's own 4-bit blocks), "int4" / "int8" (made at load), "none" (dense);
#: None = the loader's choice.
QUANTIZATION_METHODS = ("gguf", "int4", "int8", "none")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRunConfig:
    """What model runs, and how.

    Attributes:
        model: GGUF file or Hugging Face folder; None = the default model.
        dtype: the resolved compute dtype ("bfloat16", "float32", "float16"), never "auto".
        quantization: the weight format asked for (``EngineConfig.quantization``; None = the
            loader's choice).
        max_model_len: most tokens per request (prompt + output).
        seed: seed of sampling for requests without their own seed.
        max_logprobs: most logprobs / prompt_logprobs a request may ask for.
    """

    model: str | None
    dtype: str
    max_model_len: int
    quantization: str | None = None
    seed: int = 0
    max_logprobs: int = 20


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """The paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_gpu_blocks: blocks in the pool, the null block included (vLLM's name; on a CPU
            they live in host memory).
        cache_dtype: the KV cache's dtype, resolved (never "auto"): the compute dtype's name
            ("bfloat16", "float32", "float16") or an fp8 one ("fp8", "fp8_e4m3", "fp8_e5m2";
            ``EngineConfig.kv_cache_dtype``).
        enable_prefix_caching: reuse the KV blocks of earlier prompts with the same prefix.
        prefix_caching_hash_algo: the block-hash algorithm.
        hash_seed: seed of the block hashes' root (None = random per engine).
        enable_kv_cache_events: record BlockStored / BlockRemoved / AllBlocksCleared events.
        kv_offloading_backend: the KV tier below the pool: None (off), "cpu" or "disk".
        kv_offloading_blocks: the tier's capacity in blocks (0 when off).
        kv_offloading_dir: the disk tier's directory.
    """

    block_size: int
    num_gpu_blocks: int
    cache_dtype: str
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    hash_seed: int | str | bytes | None = None
    enable_kv_cache_events: bool = False
    kv_offloading_backend: str | None = None
    kv_offloading_blocks: int = 0
    kv_offloading_dir: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Continuous batching.

    Attributes:
        max_num_seqs: most requests running at once (rows of the worker's batch).
        max_num_batched_tokens: token budget of one step.
        max_model_len: most tokens per request (columns of the worker's rows).
        enable_chunked_prefill: split prompts over steps.
        policy: "fcfs" or "priority".
        preemption_mode: "recompute" (free the victim's blocks) or "swap" (page its cached
            blocks out to the KV tier first).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    preemption_mode: str = "recompute"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """How many processes run the model.

    Attributes:
        tensor_parallel_size: ranks the model's weights and KV heads are split over (1 = one
            process).
    """

    tensor_parallel_size: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedKVConfig:
    """The four sub-configs of one engine, resolved (vLLM's ``VllmConfig``)."""

    model_config: ModelRunConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """TEMPORARY stub."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    @classmethod
    def from_dict(cls, d):
        return cls(**d)

    @classmethod
    def from_json(cls, text):
        import json

        return cls(**json.loads(text))
