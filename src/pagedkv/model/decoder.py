"""What the decoders share: Llama's family (:mod:`pagedkv.model.llama`: Llama, Mistral, Qwen2,
Qwen3, Phi-3) and Gemma's (:mod:`pagedkv.model.gemma3`: Gemma 2 and 3) differ in their norms,
rotary tables, scaling and soft-caps, not in how they hold their weights. This module builds
what is the same: the model's common state (dtype, device, tensor-parallel group, KV heads,
the packing mode), a layer's linear products (fused q/k/v, o, gate, up, down, each with its
quantized form where the file keeps one), the embedding and the LM head, and each layer's
attention spec.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from pagedkv.errors import ConfigError, ModelLoadError
from pagedkv.model.config import ModelConfig
from pagedkv.model.gguf_weight import GGUFWeight
from pagedkv.model.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedkv.model.packed_linear import linear_mode, log_linear_mode
from pagedkv.model.parallel import TensorParallelGroup, check_tensor_parallel, multi_rank
from pagedkv.model.quantization import QuantizedMatmul, QuantizedWeight
from pagedkv.model.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedkv.ops.backends import AttentionLayerSpec

#: The compute dtypes a decoder runs in.
DECODER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DecoderForCausalLM:
    """The state every decoder model sets up first (its subclasses build the layers).

    Args:
        config: the model's shape.
        weights: Hugging Face-named tensors, any float dtype (or GGUF weights kept as stored).
        dtype: compute dtype (:data:`DECODER_DTYPES`).
        device: where the weights live.
        parallel: this rank's tensor-parallel group, or None (the whole model here).

    Attributes set: ``config``, ``dtype``, ``device``, ``parallel`` (None on one rank),
    ``num_kv_heads`` (this rank's share), ``pack`` (the packing mode of
    :func:`~pagedkv.model.packed_linear.linear_mode`). The weights are not kept: a subclass
    reads them through :meth:`cast` while it builds its layers, so what it does not keep can
    be freed.

    Raises:
        ModelLoadError: an unsupported dtype.
        ConfigError: a model that does not split ``parallel.world_size`` ways.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: TensorParallelGroup | None,
    ) -> None:
        if dtype not in DECODER_DTYPES:
            raise ModelLoadError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        parallel = multi_rank(parallel)
        #: this rank's tensor-parallel group; None on one rank.
        self.parallel = parallel
        #: KV heads in this process's KV cache (its share under tensor parallelism).
        self.num_kv_heads = config.num_key_value_heads
        if parallel is not None:
            self.num_kv_heads = check_tensor_parallel(config, parallel.world_size).num_kv_heads
        self.pack = linear_mode(self.device, dtype)
        if parallel is None or parallel.rank == 0:  # one warning, not one per rank
            log_linear_mode(self.pack, dtype)

    #: whether every step runs the batch-invariant path (:meth:`set_batch_invariant`)
    batch_invariant = False

    def batch_invariant_reason(self) -> str | None:
        """Why this model has no batch-invariant path, or None when it has one (a subclass
        that has one overrides this). Gemma's layers run as torch ops, whose reductions and
        vectorized tails depend on the step's size."""
        return f"{self.config.architecture} has no batch-invariant path (Llama-family models do)"

    def max_row_exact_tokens(self) -> int | None:
        """The most tokens a step may have for each of its rows to get the bits it gets alone
        (in a one-token decode step): then a speculative verification step's rows are the
        decode steps' they replace, so greedy tokens do not change with speculation and the
        model drafting for itself accepts every draft. None where no step size decides it:
        every step is batch-invariant (:meth:`set_batch_invariant`), or the layers' bits
        depend on the step's size at any size (torch's GEMMs; a subclass with a row-exact path
        overrides this). The scheduler keeps the steps that carry drafts within it
        (:class:`~pagedkv.engine.spec_decode.drafts.SpecDecodeDrafts`)."""
        return None

    def set_batch_invariant(self, on: bool) -> None:
        """Run every step on the batch-invariant path (``on``) or the fastest for its size.

        Raises:
            ConfigError: ``on`` for a model without one (:meth:`batch_invariant_reason`).
        """
        reason = self.batch_invariant_reason() if on else None
        if reason is not None:
            raise ConfigError(f"batch_invariant: {reason}")
        self.batch_invariant = on

    def cast(self, weights: Mapping[str, torch.Tensor]) -> WeightCaster:
        """``weights`` read in the model's dtype, on its device (:class:`WeightCaster`)."""
        return WeightCaster(weights, self.dtype, self.device)

    def build_embedding_and_head(
        self,
        weights: Mapping[str, torch.Tensor],
        quantized: Mapping[str, QuantizedWeight] | None,
        refine_dtype: torch.dtype,
    ) -> None:
        """Set ``embed_tokens``, ``lm_head`` (the embeddings when tied) and ``lm_head_weight``
        (:func:`refine_weight` with ``refine_dtype``) from ``weights`` (cast: :meth:`cast`).

        Raises:
            ModelLoadError: the embeddings or an untied ``lm_head.weight`` are missing.
        """
        with weights_present():
            embed = weights["model.embed_tokens.weight"]
            lm_head = embed if self.config.tie_word_embeddings else weights["lm_head.weight"]
        self.embed_tokens = VocabParallelEmbedding(embed, self.parallel)
        head_quant = quantized.get("lm_head.weight") if quantized else None
        self.lm_head = ParallelLMHead(lm_head, self.pack, self.parallel, head_quant)
        #: the dense LM head weight that :meth:`compute_logits` refines the top logits with
        #: (exact in fp32), or None (:func:`refine_weight`).
        self.lm_head_weight = refine_weight(lm_head, refine_dtype, self.parallel, head_quant)


@contextlib.contextmanager
def weights_present() -> Iterator[None]:
    """Turn a missing weight's KeyError into a :class:`~pagedkv.errors.ModelLoadError` naming it."""
    try:
        yield
    except KeyError as e:
        raise ModelLoadError(f"checkpoint lacks the weight {e.args[0]!r}") from None


def build_layer_linears(
    layer,
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    prefix: str,
    pack: str,
    parallel: TensorParallelGroup | None,
    quantized: Mapping[str, QuantizedWeight] | None,
) -> None:
    """Set a decoder layer's products and sizes: ``qkv_proj`` (q/k/v fused, with their biases
    where ``config.attention_bias``), ``o_proj``, ``gate_up_quant`` (gate and up as one
    quantized product, or None), ``gate_proj``, ``up_proj``, ``down_proj``, ``eps``,
    ``hidden_size``, ``num_heads`` / ``num_kv_heads`` (this rank's), ``head_dim``.

    Raises:
        KeyError: a weight of layer ``prefix`` is missing (see :func:`weights_present`).
    """

    def w(name: str) -> torch.Tensor:
        return weights[prefix + name]

    def linear(cls, name: str):
        quant = quantized.get(prefix + name) if quantized else None
        return cls(w(name), None, pack, parallel, quant)

    attn = "self_attn."
    qkv_bias = None
    if config.attention_bias:
        qkv_bias = tuple(w(attn + f"{p}_proj.bias") for p in "qkv")
    layer.qkv_proj = QKVParallelLinear(
        *(w(attn + f"{p}_proj.weight") for p in "qkv"),
        config.head_dim,
        qkv_bias,
        pack,
        parallel,
        qkv_quants(quantized, prefix),
    )
    layer.o_proj = linear(RowParallelLinear, attn + "o_proj.weight")
    #: gate and up quantized as one product (small steps), or None
    layer.gate_up_quant = gate_up_quant(quantized, prefix)
    layer.gate_proj = ColumnParallelLinear(w("mlp.gate_proj.weight"), None, pack, parallel)
    layer.up_proj = ColumnParallelLinear(w("mlp.up_proj.weight"), None, pack, parallel)
    layer.down_proj = linear(RowParallelLinear, "mlp.down_proj.weight")
    layer.eps = config.rms_norm_eps
    layer.hidden_size = config.hidden_size
    layer.num_heads = layer.qkv_proj.num_heads
    layer.num_kv_heads = layer.qkv_proj.num_kv_heads
    layer.head_dim = config.head_dim


def qkv_quants(
    quantized: Mapping[str, QuantizedWeight] | None, prefix: str
) -> tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight] | None:
    """Layer ``prefix``'s quantized q, k and v weights, or None unless all three are."""
    if not quantized:
        return None
    parts = tuple(quantized.get(f"{prefix}self_attn.{p}_proj.weight") for p in "qkv")
    return None if None in parts else parts


def gate_up_quant(
    quantized: Mapping[str, QuantizedWeight] | None, prefix: str
) -> QuantizedMatmul | None:
    """Layer ``prefix``'s quantized gate and up weights stacked into one product (the
    activation and the product then run on its output, in the kernel's dtype; one read of x,
    one kernel call), or None unless both are quantized."""
    if not quantized:
        return None
    parts = [quantized.get(f"{prefix}mlp.{p}_proj.weight") for p in ("gate", "up")]
    if None in parts:
        return None
    weight = QuantizedWeight.cat(parts)
    return QuantizedMatmul(weight, weight.kernels)


def refine_weight(
    lm_head: torch.Tensor,
    dtype: torch.dtype,
    parallel: TensorParallelGroup | None,
    head_quant: QuantizedWeight | None,
) -> torch.Tensor | None:
    """The dense LM head weight ``compute_logits`` recomputes the top logits with (exactly in
    fp32), or None where the logits need no refining: an fp32 model with a dense head or a
    GGUF head kept as stored (its products are fp32), or tensor parallelism. A GGUF head
    refines from its own blocks (:meth:`~pagedkv.model.gguf_weight.GGUFWeight.lookup`)."""
    refine = dtype != torch.float32 or head_quant is not None
    return lm_head if refine and parallel is None else None


def layer_attention_specs(
    layers: Sequence,
    windows: Sequence[int | None],
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype | str | None,
) -> list[AttentionLayerSpec]:
    """One :class:`AttentionLayerSpec` per decoder layer (Llama's and Gemma 3's), from the
    layer's ``num_heads``, ``num_kv_heads``, ``head_dim`` and softmax ``scale`` (this rank's
    heads under tensor parallelism) and its sliding window (None = full attention).

    Raises:
        OpsInputError: a block_size < 1 or a kv_cache_dtype the specs refuse.
    """
    return [
        AttentionLayerSpec(
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_dim,
            block_size=block_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            sliding_window=window,
            scale=layer.scale,
        )
        for layer, window in zip(layers, windows, strict=True)
    ]


class WeightCaster(Mapping):
    """Read-only view of a weight dict that casts each tensor to the model's dtype and device
    on access; a GGUF weight kept as stored stays so, its products returning the model's
    dtype."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device):
        self._weights = weights
        self._dtype = dtype
        self._device = device

    def __getitem__(self, name: str) -> torch.Tensor | GGUFWeight:
        weight = self._weights[name]
        if isinstance(weight, GGUFWeight):
            return weight.with_(dtype=self._dtype)
        return weight.to(dtype=self._dtype, device=self._device).contiguous()

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)
