"""EngineConfig: every engine option as the user types it, shared by LLM, the CLI and the server.

Which ``config`` module is which: this one holds the options as typed (vLLM's ``EngineArgs``:
``dtype="auto"``, ``block_size=None``); :mod:`pagedkv.config` the resolved, frozen sub-configs
(:func:`pagedkv.engine.config_resolution.resolve_engine_config` builds them once);
:mod:`pagedkv.core.config` the core's KV cache shape; :mod:`pagedkv.model.config` the model's
architecture.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass

from pagedkv.config import (
    QUANTIZATION_METHODS,
    SpeculativeConfig,
)
from pagedkv.core.hashing import HASH_ALGOS
from pagedkv.core.spec import KV_DTYPE_BYTES
from pagedkv.cpu_caps import DTYPE_CHOICES
from pagedkv.errors import ConfigError
from pagedkv.model.packaged_models import MODEL_ALIASES
from pagedkv.units import GiB, parse_memory_size
from pagedkv.validation import SEED_MAX, SEED_MIN, check_int, positive_int_arg

logger = logging.getLogger(__name__)

#: Values of ``dtype`` / ``--dtype`` ("auto": :func:`pagedkv.cpu_caps.resolve_dtype`).
DTYPES = DTYPE_CHOICES
#: Values of ``kv_cache_dtype`` / ``--kv-cache-dtype`` (vLLM's flag; the names of
#: :data:`pagedkv.core.spec.KV_DTYPE_BYTES`, as ``pagedkv plan --kv-cache-dtype``): "auto" = the
#: compute dtype; "fp8" = "fp8_e4m3" (float8_e4m3fn, as vLLM); "fp8_e5m2" = float8_e5m2.
KV_CACHE_DTYPES = ("auto", *KV_DTYPE_BYTES)
#: The fp8 names of KV_CACHE_DTYPES: one byte per element, whatever the compute dtype.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
#: Values of ``--attention-backend`` (``pagedkv.ops.backends.BACKEND_CHOICES``, kept here so
#: that reading the config imports no torch).
ATTENTION_BACKENDS = ("auto", "torch", "native", "vllm-cpu", "triton")

#: KV-cache budget when neither num_blocks nor kv_cache_memory is given: enough for max_num_seqs
#: requests of max_model_len tokens, but at most this many bytes (1 GiB holds about 46k tokens of
#: SmolLM2-135M in bf16).
DEFAULT_MAX_KV_CACHE_MEMORY = 1 * GiB

#: max_model_len when not given: the model's context, capped so the default KV budget stays small.
DEFAULT_MAX_MODEL_LEN_CAP = 4096

#: Values of ``--kv-offloading-backend``.
KV_OFFLOADING_BACKENDS = ("cpu", "disk")


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    """Options of :class:`pagedkv.engine.llm_engine.LLMEngine`.

    Args:
        model: GGUF file, Hugging Face folder, packaged model's short name (``smollm2``,
            ``gemma3-270m``) or Hugging Face id of the local cache
            (:func:`pagedkv.model.loader.resolve_model`); None = the default
            SmolLM2-135M-Instruct. The engine resolves it to the file or folder once, at start.
        dtype: compute dtype (and the KV cache's, with kv_cache_dtype "auto"): "auto" (vLLM's
            default: bfloat16 where the CPU computes bf16 natively (AMX, AVX-512-BF16,
            AVX-NE-CONVERT) or on CUDA, float32 elsewhere, e.g. on AVX2-only CPUs;
            :func:`pagedkv.cpu_caps.resolve_dtype`), "bfloat16", "float32" (exact) or
            "float16". The engine's ``config.dtype`` holds the resolved one.
        kv_cache_dtype: the KV cache's dtype (vLLM's ``--kv-cache-dtype``): "auto" (the compute
            dtype), "fp8" / "fp8_e4m3" (float8_e4m3fn) or "fp8_e5m2" (float8_e5m2): one byte
            per element, so the same kv_cache_memory holds 2x the blocks of bf16 (4x float32);
            K and V are stored unscaled (vLLM's default ``k_scale`` = ``v_scale`` = 1.0). A
            non-fp8 name must be the compute dtype itself ("bfloat16" with dtype bfloat16).
            The engine's ``config.kv_cache_dtype`` holds the resolved one
            (:func:`resolve_kv_cache_dtype`).
        quantization: the weights' form (vLLM's ``--quantization``): "gguf" (a GGUF file's
            blocks kept as stored, every step on pagedkv's kernels:
            :mod:`pagedkv.model.gguf_weight`), "int4" / "int8" (made at load, for steps of at
            most ``QUANT_MAX_TOKENS`` tokens, larger ones dense: :mod:`pagedkv.model.
            quantization`), "none" (dense); None = "gguf" for a GGUF file where pagedkv's
            kernels run on one rank, else "none"
            (:func:`pagedkv.model.loader.resolve_quantization`), and "none" when dtype is an
            explicit "float32" (the dense reference; :func:`default_quantization`).
        block_size: tokens per KV block; None = the attention backend's fastest
            (``default_block_size``: 16 for torch and native, 128 for vllm-cpu). A size the
            chosen backend does not run is a ConfigError naming both.
        attention_backend: which attention backend owns the KV cache and runs attention
            (vLLM's ``--attention-backend``): "auto" (native for an fp32 or bf16 model on an
            AVX2 CPU with a C compiler, else vllm-cpu when installed and this CPU runs it, else
            torch; triton on CUDA), "torch", "native", "vllm-cpu" or "triton" (see
            :func:`pagedkv.ops.backends.select_backend`; the engine logs its choice).
        num_blocks: KV blocks in the pool (including the null block); wins over kv_cache_memory.
        kv_cache_memory: bytes for the KV cache (all layers), an int or a size such as
            ``"1GiB"``, ``"512MiB"``, ``"1G"`` (:func:`pagedkv.units.parse_memory_size`, as the
            ``--kv-cache-memory`` flag); None = enough for max_num_seqs x max_model_len tokens,
            capped at DEFAULT_MAX_KV_CACHE_MEMORY.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (chunked prefill splits longer prompts).
        max_model_len: most tokens per request (prompt + output); None = the model's context
            capped at DEFAULT_MAX_MODEL_LEN_CAP. Larger than the model's context is refused
            unless allow_long_max_model_len.
        allow_long_max_model_len: accept a max_model_len beyond the model's context
            (``max_position_embeddings``); rotary positions then extrapolate past what the
            model was trained on (vLLM: ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``).
        enable_prefix_caching: reuse cached KV blocks of earlier prompts with the same prefix.
        enable_chunked_prefill: split prompts over steps; off needs max_num_batched_tokens >=
            max_model_len.
        disable_hybrid_kv_cache_manager: hold every layer's KV as full attention, one KV cache
            group (vLLM's flag of the same name): sliding-window layers keep every block of a
            request instead of giving back the blocks that left their window. They still attend
            only to their window; only memory changes (for comparisons).
        policy: "fcfs" or "priority".
        hash_algo: block-hash algorithm of the prefix cache ("sha256" default, or a fast one
            offered by pagedkv.core.hashing).
        hash_seed: seed of the block hashes' root (int, str or bytes); replicas that share it
            compute the same hashes, so a router can predict their prefix-cache hits. None = a
            random root per engine.
        enable_kv_cache_events: record BlockStored / BlockRemoved / AllBlocksCleared events
            (drain them with ``LLMEngine.take_kv_cache_events()``).
        seed: seed of sampling for requests without their own seed.
        num_threads: torch threads (per rank); None = all CPUs this process may use, divided
            by tensor_parallel_size.
        tensor_parallel_size: processes the model is split over (vLLM's field of the same name;
            :mod:`pagedkv.worker.tp_executor`, docs/parallel.md); 1 = one process, today's path.
        kv_offloading_size: bytes of the KV tier below the block pool (vLLM's
            ``--kv-offloading-size``; an int or a size such as ``"4GiB"``): cached blocks the
            pool evicts page out there by block hash, and prefix hits page them back in
            (docs/core.md). None = no tier (nothing changes).
        kv_offloading_backend: ``"cpu"`` (host RAM; the default when a size is given) or
            ``"disk"`` (files in ``kv_offloading_dir``; they survive a restart).
        kv_offloading_dir: the disk tier's directory.
        preemption_mode: ``"recompute"`` (default) or ``"swap"`` (vLLM V0's word: a preempted
            request's cached blocks page out to the tier at once; needs a tier).
        speculative_config: speculative decoding (vLLM's ``--speculative-config``): a
            :class:`~pagedkv.config.SpeculativeConfig`, its dict, or its JSON text (e.g.
            ``{"method": "ngram", "num_speculative_tokens": 3}``); None: off.
        batch_invariant: every request's tokens and logprobs depend on its own tokens only,
            never on the batch it shares a step with, how its prompt was chunked, a prefix-cache
            hit, preemption, the KV tier, forks or speculation (vLLM's
            ``VLLM_BATCH_INVARIANT=1``; docs/engine.md, "Batch invariance"). Every step then
            runs pagedkv's C decoder layers with one reduction order per row, whatever its
            size: Llama-family models (not Gemma), the native attention backend, one rank,
            weights as a GGUF file stores them or dense (run as F32 / BF16 blocks), not int4 /
            int8 made at load. Off by default: it costs large steps their GEMM (measured there).

    Raises:
        ConfigError: an unknown dtype or kv_cache_dtype, a count out of range, or a
            kv_cache_memory string that is not a size.
    """

    model: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    block_size: int | None = None
    attention_backend: str = "auto"
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    allow_long_max_model_len: bool = False
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    policy: str = "fcfs"
    hash_algo: str = "sha256"
    hash_seed: int | str | bytes | None = None
    enable_kv_cache_events: bool = False
    seed: int = 0
    max_logprobs: int = 20
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    kv_offloading_size: int | str | None = None
    kv_offloading_backend: str | None = None
    kv_offloading_dir: str | None = None
    preemption_mode: str = "recompute"
    speculative_config: SpeculativeConfig | dict | str | None = None
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, str):
            self.speculative_config = SpeculativeConfig.from_json(self.speculative_config)
        elif isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        elif not isinstance(self.speculative_config, SpeculativeConfig | None):
            raise ConfigError(
                "speculative_config must be a SpeculativeConfig, a dict or JSON text, got "
                f"{type(self.speculative_config).__name__}"
            )
        if (
            isinstance(self.speculative_config, SpeculativeConfig)
            and self.speculative_config.uses_draft_model
            and self.tensor_parallel_size > 1
        ):
            raise ConfigError(
                "speculative_config: method 'draft_model' runs with tensor_parallel_size 1 only"
            )
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_memory_size(self.kv_cache_memory)
        if isinstance(self.kv_offloading_size, str):
            self.kv_offloading_size = parse_memory_size(self.kv_offloading_size)
        check_int("kv_offloading_size", self.kv_offloading_size, 1, optional=True)
        if self.kv_offloading_backend is not None:
            if self.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
                raise ConfigError(
                    f"kv_offloading_backend must be one of {KV_OFFLOADING_BACKENDS}, got "
                    f"{self.kv_offloading_backend!r}"
                )
            if self.kv_offloading_size is None:
                raise ConfigError("kv_offloading_backend needs kv_offloading_size (bytes)")
        if self.kv_offloading_size is not None:
            if self.kv_offloading_backend is None:
                self.kv_offloading_backend = "cpu"
            if self.tensor_parallel_size > 1:
                raise ConfigError("KV offloading runs with tensor_parallel_size 1 only")
            if not self.enable_prefix_caching:
                raise ConfigError("KV offloading needs prefix caching (keyed by block hash)")
        if (self.kv_offloading_backend == "disk") != (self.kv_offloading_dir is not None):
            raise ConfigError(
                "kv_offloading_dir goes with kv_offloading_backend='disk' (and it needs one)"
            )
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if self.batch_invariant:
            check_batch_invariant_options(self)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and self.kv_offloading_size is None:
            raise ConfigError("preemption_mode='swap' needs a KV tier (kv_offloading_size)")
        check_int("seed", self.seed, SEED_MIN, maximum=SEED_MAX, why="64-bit")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"quantization must be one of {QUANTIZATION_METHODS} or None, got "
                f"{self.quantization!r}"
            )
        if self.quantization not in (None, "none") and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"quantization {self.quantization!r} runs with tensor_parallel_size 1 only"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                f"{self.attention_backend!r}"
            )
        check_int("block_size", self.block_size, 1, optional=True)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            check_int(name, getattr(self, name), 1)
        check_int("max_logprobs", self.max_logprobs, 0)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("num_blocks", self.num_blocks, 2, optional=True, why="block 0 is the null block")
        if self.hash_seed is not None and (
            not isinstance(self.hash_seed, (int, str, bytes)) or isinstance(self.hash_seed, bool)
        ):
            raise ConfigError(
                f"hash_seed must be an int, str, bytes or None, got {self.hash_seed!r}"
            )
        for name in ("kv_cache_memory", "max_model_len", "num_threads"):
            check_int(name, getattr(self, name), 1, optional=True)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add ``--model`` / ``-m`` (llama.cpp's), ``--dtype``, ... (one flag per field) to
        ``parser``."""
        d = EngineConfig()
        group = parser.add_argument_group("engine")
        group.add_argument(
            "--model",
            "-m",
            default=None,
            help="a .gguf file, a Hugging Face folder, a packaged model "
            f"({', '.join(MODEL_ALIASES)}; default {next(iter(MODEL_ALIASES))}: "
            "SmolLM2-135M-Instruct), or a Hugging Face id in the local Hugging Face cache "
            "($HF_HOME; nothing is downloaded)",
        )
        group.add_argument(
            "--dtype",
            default=d.dtype,
            choices=DTYPES,
            help="compute dtype (auto: bfloat16 where the CPU computes bf16 natively, float32 "
            "elsewhere; the start log says which)",
        )
        group.add_argument(
            "--kv-cache-dtype",
            default=d.kv_cache_dtype,
            choices=KV_CACHE_DTYPES,
            help="KV-cache dtype (auto: the compute dtype; fp8 = fp8_e4m3, or fp8_e5m2: one "
            "byte per element, twice the blocks of bf16 in the same memory)",
        )
        group.add_argument(
            "--quantization",
            "-q",
            default=None,
            choices=QUANTIZATION_METHODS,
            help="weight form (default: a GGUF file's blocks as stored, every step on pagedkv's "
            "kernels, where this CPU runs them; int4 / int8 made at load for small steps; none = "
            "dense weights, which an explicit --dtype float32 also picks)",
        )
        group.add_argument(
            "--speculative-config",
            default=None,
            help='speculative decoding, as JSON (vLLM\'s keys), e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\' or \'{"method": "suffix"}\' '
            "(default: off)",
        )
        group.add_argument(
            "--block-size",
            type=positive_int_arg,
            default=None,
            help="tokens per KV block (default: the attention backend's fastest)",
        )
        group.add_argument(
            "--attention-backend",
            default=d.attention_backend,
            choices=ATTENTION_BACKENDS,
            help="who owns the KV cache and runs attention (auto: vllm-cpu when installed and "
            "supported, else torch; triton on CUDA)",
        )
        group.add_argument(
            "--num-blocks", type=positive_int_arg, default=None, help="KV blocks in the pool"
        )
        group.add_argument(
            "--kv-cache-memory",
            type=_parse_bytes,
            default=None,
            help="KV cache budget, bytes or with a unit (512MiB, 2GiB, 1G)",
        )
        group.add_argument("--max-num-seqs", type=positive_int_arg, default=d.max_num_seqs)
        group.add_argument(
            "--max-num-batched-tokens", type=positive_int_arg, default=d.max_num_batched_tokens
        )
        group.add_argument("--max-model-len", type=positive_int_arg, default=None)
        group.add_argument(
            "--allow-long-max-model-len",
            action="store_true",
            help="accept a --max-model-len beyond the model's context (outputs may degrade)",
        )
        group.add_argument(
            "--no-prefix-caching", dest="enable_prefix_caching", action="store_false"
        )
        group.add_argument(
            "--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false"
        )
        group.add_argument(
            "--disable-hybrid-kv-cache-manager",
            action="store_true",
            help="hold sliding-window layers' KV as full attention (one group; for comparisons)",
        )
        group.add_argument("--policy", default=d.policy, choices=("fcfs", "priority"))
        group.add_argument(
            "--prefix-caching-hash-algo",
            dest="hash_algo",
            default=d.hash_algo,
            choices=tuple(HASH_ALGOS),
            help="block-hash algorithm of the prefix cache",
        )
        group.add_argument("--seed", type=int, default=d.seed)
        group.add_argument(
            "--max-logprobs",
            type=int,
            default=d.max_logprobs,
            help="most logprobs / prompt_logprobs a request may ask for",
        )
        group.add_argument(
            "--num-threads",
            type=positive_int_arg,
            default=None,
            help="torch threads per rank (default: the usable CPUs / tensor-parallel size)",
        )
        group.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=positive_int_arg,
            default=d.tensor_parallel_size,
            help="split the model over this many processes (torch.distributed)",
        )
        group.add_argument(
            "--kv-offloading-size",
            type=_parse_bytes,
            default=None,
            help="bytes of the KV tier below the block pool (evicted blocks page out there by "
            "block hash; 512MiB, 4GiB); default: no tier",
        )
        group.add_argument(
            "--kv-offloading-backend",
            default=None,
            choices=KV_OFFLOADING_BACKENDS,
            help="the KV tier's medium: cpu (host RAM, the default) or disk (survives restarts)",
        )
        group.add_argument("--kv-offloading-dir", default=None, help="the disk KV tier's directory")
        group.add_argument(
            "--preemption-mode",
            default=d.preemption_mode,
            choices=("recompute", "swap"),
            help="what a preempted request's blocks do: recompute, or swap to the KV tier",
        )
        group.add_argument(
            "--batch-invariant",
            action="store_true",
            help="a request's tokens and logprobs bit-identical whatever it shares a step with, "
            "however its KV blocks were made (prefix hit, chunk, preemption, KV tier, fork, "
            "speculation); Llama-family models, native attention, one rank",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config from parsed :meth:`add_cli_args` flags."""
        names = [f.name for f in dataclasses.fields(cls) if hasattr(args, f.name)]
        return cls(**{name: getattr(args, name) for name in names})


def check_batch_invariant_options(config: EngineConfig) -> None:
    """Refuse what ``batch_invariant`` cannot run with, before anything loads (the model's own
    checks follow when it is read: its architecture, its products on pagedkv's kernels).

    Raises:
        ConfigError: tensor_parallel_size > 1 (the ranks' partial products would be summed
            in a step-dependent layout: not built), an attention backend other than
            ``native`` or ``auto`` (the native backend reduces each query's keys in fixed
            pieces at absolute positions; the others do not promise it), int4 / int8 made at
            load (their products take another path for large steps), or kv_cache_dtype fp8
            (the native backend holds fp32 or bf16).
    """
    if config.tensor_parallel_size > 1:
        raise ConfigError("batch_invariant runs with tensor_parallel_size 1 only")
    if config.attention_backend not in ("auto", "native"):
        raise ConfigError(
            f"batch_invariant runs with the native attention backend, not "
            f"{config.attention_backend!r} (attention_backend 'auto' or 'native')"
        )
    if config.quantization in ("int4", "int8"):
        raise ConfigError(
            f"batch_invariant does not run quantization {config.quantization!r} (made at load "
            "for small steps only): a GGUF file's own blocks ('gguf') or dense weights ('none')"
        )
    if config.kv_cache_dtype.startswith("fp8"):
        raise ConfigError(
            "batch_invariant runs a float32 or bfloat16 KV cache (the native attention "
            f"backend's), not kv_cache_dtype {config.kv_cache_dtype!r}"
        )


def default_quantization(quantization: str | None, requested_dtype: str) -> str | None:
    """The quantization an engine asks its loader for: ``quantization`` as given, except that
    the default (None: the loader keeps a GGUF file's blocks as stored where pagedkv's kernels
    run) becomes "none" when ``requested_dtype`` is an explicit "float32": the dense float32
    reference, whose products use the same values in another summation order (the logged
    line says so; ``--quantization gguf`` keeps the blocks, with fp32 products, in the file's
    memory)."""
    if quantization is None and requested_dtype == "float32":
        logger.info(
            "quantization none: --dtype float32 asks for the dense float32 reference (the "
            "model dequantized in memory); --quantization gguf keeps a GGUF file's blocks as "
            "stored, with float32 products"
        )
        return "none"
    return quantization


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The KV-cache dtype an engine computing in ``dtype`` runs for ``kv_cache_dtype``.

    Args:
        kv_cache_dtype: one of :data:`KV_CACHE_DTYPES`.
        dtype: the resolved compute dtype ("bfloat16", "float32", "float16"), never "auto".

    Returns:
        ``dtype`` for "auto", else ``kv_cache_dtype`` itself (an fp8 name, or the compute
        dtype's own name).

    Raises:
        ConfigError: an unknown name, or a non-fp8 dtype other than the compute dtype (the
            attention backends store K/V in the compute dtype or in fp8); the message names
            the field, its flag and the values that run.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES or kv_cache_dtype == dtype:
        return kv_cache_dtype
    raise ConfigError(
        f"kv_cache_dtype (--kv-cache-dtype) {kv_cache_dtype} cannot be used with the compute "
        f"dtype {dtype}: the attention backends store K and V in the compute dtype or in fp8. "
        f"Choose auto ({dtype}), {', '.join(FP8_KV_CACHE_DTYPES)}, or --dtype {kv_cache_dtype}"
    )


def _parse_bytes(text: str) -> int:
    """argparse type of ``--kv-cache-memory``: :func:`pagedkv.units.parse_memory_size`, the one
    size parser that plan, simulate and ``EngineConfig(kv_cache_memory="2GiB")`` use."""
    try:
        return parse_memory_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
