"""The engine's resolved configuration (frozen sub-configs, vLLM's ``VllmConfig``), torch-free.

Which ``config`` module is which: :mod:`pagedkv.engine.config` holds the options as the user
types them (``EngineConfig``, the CLI flags); this module the resolved sub-configs every part
reads; :mod:`pagedkv.core.config` the core's KV cache shape (blocks, groups, specs);
:mod:`pagedkv.model.config` the model's architecture (read from its files).

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
ParallelConfig      tensor_parallel_size, num_threads                 executor factory
SpeculativeConfig   method, num_speculative_tokens, prompt_lookup_*,  proposers, rejection
                    suffix_decoding_*                                 sampler, scheduler
==================  ==============================================  ==========================

(vLLM calls the first ``ModelConfig``; here that name is the model's architecture,
:class:`pagedkv.model.config.ModelConfig`.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.validation import check_int, check_number

#: Environment variable that overrides pagedkv's cache directory.
CACHE_DIR_ENV = "PAGEDKV_CACHE_DIR"


def cache_dir() -> Path:
    """pagedkv's cache directory (assembled models, compiled kernels, llama.cpp builds):
    ``$PAGEDKV_CACHE_DIR`` if set, else ``~/.cache/pagedkv``."""
    value = os.environ.get(CACHE_DIR_ENV)
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "pagedkv"


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
        batch_invariant: every step on the batch-invariant path (``EngineConfig.
            batch_invariant``).
    """

    model: str | None
    dtype: str
    max_model_len: int
    quantization: str | None = None
    seed: int = 0
    max_logprobs: int = 20
    batch_invariant: bool = False


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
        num_threads: torch threads per rank; None = every CPU this process may use.
    """

    tensor_parallel_size: int = 1
    num_threads: int | None = None


#: Values of ``SpeculativeConfig.method`` (vLLM's names) that pagedkv builds.
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")

#: Methods vLLM has that are parsed but refused, with why.
_UNBUILT_SPECULATIVE_METHODS = {
    method: f"speculative decoding with {method} heads is not built; use 'ngram', 'suffix' or "
    "'draft_model'"
    for method in ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
}

#: The keys of ``--speculative-config`` pagedkv reads (vLLM's names).
_SPECULATIVE_KEYS = frozenset(
    {
        "method",
        "model",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` JSON, its key names and defaults).

    A proposer drafts up to ``num_speculative_tokens`` tokens per request per step, from the
    request's own tokens (ngram, suffix) or with a small draft model (draft_model); the target
    model scores them all in one forward and the rejection sampler keeps the longest prefix the
    target agrees with, plus one token of its own (:mod:`pagedkv.worker.spec_decode`,
    :mod:`pagedkv.worker.rejection_sampler`).

    Attributes:
        method: "ngram" (prompt lookup decoding), "suffix" (SuffixDecoding, Oliaro et al.
            2024) or "draft_model" (a second, smaller model with the same tokenizer drafts
            greedily; Leviathan et al. 2023).
        num_speculative_tokens: most draft tokens per request per step (>= 1). Required for
            "ngram" and "draft_model"; "suffix" defaults it to
            ``suffix_decoding_max_tree_depth`` (as vLLM).
        model: draft_model: the draft model, anything ``--model`` takes (a packaged short
            name, a GGUF file, a Hugging Face folder); None for the other methods.
        prompt_lookup_min, prompt_lookup_max: ngram: the n-gram lengths matched, tokens
            (``1 <= min <= max``; both default to 5, one given sets the other to it, as vLLM).
        suffix_decoding_max_tree_depth: suffix: the suffix trees' depth, tokens (>= 1); it caps
            match length + draft length (vLLM's default 24).
        suffix_decoding_max_cached_requests: suffix: finished requests whose outputs the global
            tree holds, oldest evicted first (>= 0; 0 = no global tree; default 10000).
        suffix_decoding_max_spec_factor: suffix: draft length <= this x the match length
            (>= 0; default 1.0).
        suffix_decoding_min_token_prob: suffix: a draft token's estimated probability (from
            the trees' counts) must be at least this ([0, 1]; default 0.1).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config: method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        check_int("speculative_config: prompt_lookup_min", self.prompt_lookup_min, 1)
        check_int(
            "speculative_config: prompt_lookup_max",
            self.prompt_lookup_max,
            self.prompt_lookup_min,
            why="at least prompt_lookup_min",
        )
        check_int(
            "speculative_config: suffix_decoding_max_tree_depth",
            self.suffix_decoding_max_tree_depth,
            1,
        )
        check_int(
            "speculative_config: suffix_decoding_max_cached_requests",
            self.suffix_decoding_max_cached_requests,
            0,
        )
        check_number(
            "speculative_config: suffix_decoding_max_spec_factor",
            self.suffix_decoding_max_spec_factor,
            0,
            finite=True,
        )
        check_number(
            "speculative_config: suffix_decoding_min_token_prob",
            self.suffix_decoding_min_token_prob,
            0,
            maximum=1,
        )
        if self.uses_draft_model != (self.model is not None):
            raise ConfigError(
                "speculative_config: model is required for method 'draft_model' and taken by no "
                "other method"
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(
                f"speculative_config: model must be a model name or path, got {self.model!r}"
            )
        # Last: suffix defaults it from suffix_decoding_max_tree_depth, checked above.
        check_int("speculative_config: num_speculative_tokens", self.num_speculative_tokens, 1)

    @property
    def uses_draft_model(self) -> bool:
        """True when a second model drafts (method "draft_model"): its KV shares the target's
        block pool and the scheduler allocates lookahead slots for its drafts."""
        return self.method == "draft_model"

    def summary(self) -> str:
        """One line for the start-up log: the method, its draft length and its settings."""
        if self.method == "ngram":
            detail = f"n-grams of {self.prompt_lookup_min}-{self.prompt_lookup_max} tokens"
        elif self.method == "suffix":
            detail = (
                f"tree depth {self.suffix_decoding_max_tree_depth}, "
                f"min token prob {self.suffix_decoding_min_token_prob:g}"
            )
        else:
            detail = f"draft model {self.model}"
        return (
            f"speculative decoding: {self.method}, up to {self.num_speculative_tokens} draft "
            f"tokens per request per step ({detail})"
        )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        """The config of vLLM's ``--speculative-config`` dict, defaults resolved.

        Raises:
            ConfigError: not a dict; a key pagedkv does not read (named); a value of the wrong
                type or out of range (named); no ``method`` (and no ``model``: then it is
                "draft_model"); a method pagedkv lacks (EAGLE, Medusa, MTP heads); ``model``
                with a method that takes none, or none with "draft_model";
                ``num_speculative_tokens`` missing for "ngram" or "draft_model".
        """
        if not isinstance(config, dict):
            raise ConfigError(
                f"speculative_config must be a JSON object, got {type(config).__name__}"
            )
        unknown = sorted(str(k) for k in config if k not in _SPECULATIVE_KEYS)
        if unknown:
            raise ConfigError(
                f"speculative_config: unknown key(s) {unknown}; pagedkv reads "
                f"{sorted(_SPECULATIVE_KEYS)}"
            )
        method = config.get("method")
        if method == "[ngram]":  # vLLM's older spelling
            method = "ngram"
        if method is None:
            if "model" in config:
                method = "draft_model"
            else:
                raise ConfigError(
                    f"speculative_config: method is required, one of {SPECULATIVE_METHODS}"
                )
        if not isinstance(method, str):
            raise ConfigError(f"speculative_config: method must be a string, got {method!r}")
        if method in _UNBUILT_SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config: method {method!r}: {_UNBUILT_SPECULATIVE_METHODS[method]}"
            )
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config: method must be one of {SPECULATIVE_METHODS}, got {method!r}"
            )
        if "model" in config and method != "draft_model":
            raise ConfigError(
                f"speculative_config: model is for method 'draft_model'; method {method!r} "
                "drafts from the request's own tokens and takes no model"
            )
        if method == "draft_model" and config.get("model") is None:
            raise ConfigError("speculative_config: model is required for method 'draft_model'")
        fields = {k: v for k, v in config.items() if k != "method"}
        if method in ("ngram", "draft_model") and "num_speculative_tokens" not in fields:
            raise ConfigError(
                f"speculative_config: num_speculative_tokens is required for method {method!r}"
            )
        if method == "ngram":
            lookup_min = fields.get("prompt_lookup_min")
            lookup_max = fields.get("prompt_lookup_max")
            if lookup_min is None and lookup_max is None:
                lookup_min = lookup_max = 5
            elif lookup_min is None:
                lookup_min = lookup_max
            elif lookup_max is None:
                lookup_max = lookup_min
            fields["prompt_lookup_min"] = lookup_min
            fields["prompt_lookup_max"] = lookup_max
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if key in fields:
                    raise ConfigError(
                        f"speculative_config: {key} is for method 'ngram', not {method!r}"
                    )
        if method == "suffix" and fields.get("num_speculative_tokens") is None:
            fields["num_speculative_tokens"] = fields.get("suffix_decoding_max_tree_depth", 24)
        if method != "suffix":
            suffix_keys = sorted(k for k in fields if k.startswith("suffix_decoding_"))
            if suffix_keys:
                raise ConfigError(
                    f"speculative_config: {suffix_keys} are for method 'suffix', not {method!r}"
                )
        return cls(method=method, **fields)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config of vLLM's ``--speculative-config`` JSON string (:meth:`from_dict`).

        Raises:
            ConfigError: not valid JSON, or as :meth:`from_dict`.
        """
        try:
            config = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        return cls.from_dict(config)


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedKVConfig:
    """The sub-configs of one engine, resolved once and frozen (vLLM's ``VllmConfig``; built by
    :func:`pagedkv.engine.config_resolution.resolve_engine_config`, read as ``engine.config``);
    speculative decoding's is None when it is off. Every resolved setting has one home here:
    ``cache_config.block_size``, ``model_config.max_model_len`` (also
    ``scheduler_config.max_model_len``, the same value set from it), ``model_config.dtype``..."""

    model_config: ModelRunConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None = None
