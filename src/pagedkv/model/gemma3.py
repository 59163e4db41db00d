"""Gemma 3 (text) and Gemma 2 over a paged KV cache, with sliding-window and full-attention layers.

The architecture as Hugging Face transformers implements it (``Gemma3ForCausalLM``)::

    h = embed(input_ids) * sqrt(hidden)   (the factor rounded to the model dtype)   [T, hidden]
    for each layer (5 sliding-window layers, then 1 full-attention layer, repeated):
        x = norm(h)
        q, k, v = x @ W_q, x @ W_k, x @ W_v
        q, k = norm_q(q), norm_k(k)       (per head, over head_dim)
        q, k = rotary(q), rotary(k)       (base 10k on sliding-window layers, 1M on global ones)
        write_kv(k, v -> slots);  a = attention(q, scale query_pre_attn_scalar ** -0.5, ...)
                                  (sliding-window layers see the last sliding_window positions)
        h = h + norm(a @ W_o)
        x = norm(h)
        h = h + norm((gelu_tanh(x @ W_gate) * (x @ W_up)) @ W_down)
    return norm(h);   logits = h @ embed^T  (tied)

Every norm is Gemma's RMSNorm, ``rms_norm(x) * (1 + weight)`` computed in fp32 and cast back to
the model dtype, with its own weight (input, post-attention, pre-MLP, post-MLP, q, k, final).

Gemma 2 is the same decoder driven by its config: no q/k norms (``config.qk_norm`` False), every
other layer sliding-window (layers 0, 2, ...), one rope base for all layers, attention scores
soft-capped (``cap * tanh(scores / cap)``, cap 50, before the softmax: the attention backend
applies it, :meth:`Gemma3ForCausalLM.attention_layer_specs` puts it in the layers' specs) and
the logits soft-capped (cap 30).

Each layer reads the :class:`~pagedkv.ops.backends.BoundAttentionMetadata` of its own KV cache
group and spec (:meth:`Gemma3ForCausalLM.attention_layer_specs`): the forward takes one per layer
(layers of a group share one object), so that sliding-window layers get block tables, slot
mappings and backend metadata built with their window, full-attention layers theirs; the write
and the attention go through the attention backend, which owns the cache layout. Weights are
frozen; the model only runs under ``torch.inference_mode``.

Tensor parallelism (``parallel``, docs/parallel.md) uses Llama's parallel layers and the same
forward: q/k/v (whole heads; the q/k norms are per head, so each rank normalizes its own), gate
and up column parallel; o_proj and down_proj row parallel, whose all-reduce comes before their
post-norm (Gemma normalizes the sum, so the residual add is not fused); the embedding and the
tied LM head split by vocabulary rows (the ``sqrt(hidden)`` scale applied after the embedding's
all-reduce, the soft-capping after the LM head's gather).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from pagedkv.errors import ModelLoadError, OpsInputError
from pagedkv.model.config import GEMMA_ARCHITECTURES, ModelConfig
from pagedkv.model.decoder import (
    DecoderForCausalLM,
    build_layer_linears,
    layer_attention_specs,
    weights_present,
)
from pagedkv.model.logits import refine_top_logits
from pagedkv.model.parallel import TensorParallelGroup
from pagedkv.model.quantization import QUANT_MAX_TOKENS, QuantizedWeight
from pagedkv.model.rotary import rope_inv_freq
from pagedkv.ops.backends import AttentionLayerSpec, BoundAttentionMetadata


class _Rotary:
    """Rotary embedding in rotate-half layout with cos/sin computed per forward from the
    positions (``positions * inv_freq`` in fp32, as transformers does), instead of tables over
    the whole 32k context (128 MiB in fp32 for Gemma's head_dim 256 and two rope bases)."""

    __slots__ = ("dtype", "half", "inv_freq")

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device):
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.half = inv_freq.numel()
        self.dtype = dtype

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (``[-sin, sin]``) of ``positions`` ``[T]``, each
        ``[T, 1, head_dim]`` in the model dtype."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = torch.cat((freqs, freqs), dim=-1).cos()
        sin = freqs.sin()
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, num_heads, head_dim]``: ``x * cos + rotate_half(x) * sin``."""
        return torch.addcmul(x * cos, x.roll(self.half, -1), sin)


class Gemma3DecoderLayer:
    """One Gemma 3 decoder layer (see the module docstring); under tensor parallelism
    (``parallel``) this rank's heads and MLP slice, with the same forward."""

    __slots__ = (
        "down_proj",
        "dtype",
        "eps",
        "gate_proj",
        "gate_up_quant",
        "head_dim",
        "hidden_size",
        "input_norm",
        "k_norm",
        "num_heads",
        "num_kv_heads",
        "o_proj",
        "post_attention_norm",
        "post_feedforward_norm",
        "pre_feedforward_norm",
        "q_norm",
        "qkv_proj",
        "rotary",
        "scale",
        "sliding_window",
        "up_proj",
    )

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        prefix: str,
        rotary: _Rotary,
        sliding_window: int | None,
        pack: str,
        dtype: torch.dtype,
        parallel: TensorParallelGroup | None = None,
        quantized: Mapping[str, QuantizedWeight] | None = None,
    ):
        build_layer_linears(self, config, weights, prefix, pack, parallel, quantized)

        def norm(name: str) -> torch.Tensor:  # (1 + weight) in fp32, as Gemma3RMSNorm
            return 1.0 + weights[prefix + name].float()

        attn = "self_attn."
        self.input_norm = norm("input_layernorm.weight")
        self.post_attention_norm = norm("post_attention_layernorm.weight")
        self.pre_feedforward_norm = norm("pre_feedforward_layernorm.weight")
        self.post_feedforward_norm = norm("post_feedforward_layernorm.weight")
        #: the per-head q and k norms' (1 + weight) (Gemma 3), None without (Gemma 2)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = norm(attn + "q_norm.weight")
            self.k_norm = norm(attn + "k_norm.weight")
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.scale = float(scalar) ** -0.5
        self.sliding_window = sliding_window
        self.rotary = rotary
        self.dtype = dtype

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, size: int) -> torch.Tensor:
        """Gemma RMSNorm over the last ``size`` elements, in fp32, back to the model dtype."""
        return F.rms_norm(x.float(), (size,), weight, self.eps).to(self.dtype)

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: BoundAttentionMetadata,
    ) -> torch.Tensor:
        """Residual stream ``h`` ``[T, hidden]`` in, updated residual stream out (the same on
        every rank under tensor parallelism: o_proj and down_proj sum the ranks')."""
        num_tokens = h.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        x = self._norm(h, self.input_norm, self.hidden_size)
        qkv = self.qkv_proj(x).view(num_tokens, heads + 2 * kv_heads, head_dim)
        q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
        if self.q_norm is not None:
            q = self._norm(q, self.q_norm, head_dim)
            k = self._norm(k, self.k_norm, head_dim)
        q = self.rotary.apply(q, cos, sin)
        k = self.rotary.apply(k, cos, sin)
        v = qkv[:, heads + kv_heads :]
        attn_metadata.write_kv(k, v, kv_cache)
        attn = attn_metadata.forward(q, kv_cache)
        o = self.o_proj(attn.reshape(num_tokens, -1))
        h = h + self._norm(o, self.post_attention_norm, self.hidden_size)
        x = self._norm(h, self.pre_feedforward_norm, self.hidden_size)
        if self.gate_up_quant is not None and num_tokens <= QUANT_MAX_TOKENS:
            quant = self.gate_up_quant
            gate, up = quant(x, quant.kernel_dtype).chunk(2, dim=1)
            m = self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        else:
            m = self.down_proj(self.up_proj.mul(x, self.gate_proj.gelu_tanh(x)))
        return h + self._norm(m, self.post_feedforward_norm, self.hidden_size)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 or Gemma 2 causal LM over a paged KV cache (see the module docstring); same
    interface as :class:`pagedkv.model.llama.LlamaForCausalLM` except that ``forward`` takes one
    :class:`BoundAttentionMetadata` per layer.

    Args:
        config: a ``gemma3`` or ``gemma2`` :class:`ModelConfig` (layer_types, sliding_window,
            softcaps, ...).
        weights: Hugging Face-named tensors (``model.layers.0.self_attn.q_norm.weight``, ...;
            norm weights in Hugging Face's form, without the +1), any float dtype;
            ``lm_head.weight`` may be absent when the embeddings are tied.
        dtype: compute dtype (``torch.float32`` or ``torch.bfloat16``).
        device: where the weights live.
        parallel: this rank's tensor-parallel group (:mod:`pagedkv.model.parallel`): the model
            keeps its shard only (heads, MLP slice, vocabulary rows) and runs the collectives;
            None = the whole model in this process.
        quantized: linear weights also held quantized (as
            :class:`~pagedkv.model.llama.LlamaForCausalLM`'s); one rank only.

    Raises:
        ModelLoadError: not a gemma3 / gemma2 config, a missing weight or an unsupported dtype.
        ConfigError: a model that does not split ``parallel.world_size`` ways.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        parallel: TensorParallelGroup | None = None,
        quantized: Mapping[str, QuantizedWeight] | None = None,
    ):
        if config.architecture not in GEMMA_ARCHITECTURES:
            raise ModelLoadError(
                f"Gemma3ForCausalLM runs gemma3 and gemma2 models, got {config.architecture}"
            )
        super().__init__(config, weights, dtype, device, parallel)
        parallel, pack, cast = self.parallel, self.pack, self.cast(weights)
        #: per layer, its sliding window (tokens) or None for full attention.
        self.layer_sliding_windows = config.layer_sliding_windows
        local = dataclasses.replace(
            config, rope_theta=config.rope_local_theta or config.rope_theta, rope_scaling=None
        )
        self.rotary_global = _Rotary(rope_inv_freq(config), dtype, self.device)
        self.rotary_local = _Rotary(rope_inv_freq(local), dtype, self.device)
        #: sqrt(hidden_size) rounded to the model dtype (as transformers: 25.25 in bf16).
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype, device=self.device)
        with weights_present():
            self.layers = [
                Gemma3DecoderLayer(
                    config,
                    cast,
                    f"model.layers.{i}.",
                    self.rotary_global if window is None else self.rotary_local,
                    window,
                    pack,
                    dtype,
                    parallel,
                    quantized,
                )
                for i, window in enumerate(self.layer_sliding_windows)
            ]
            self.norm = 1.0 + cast["model.norm.weight"].float()
        # a dense head is not refined here: its top logits are refined only from a quantized one
        self.build_embedding_and_head(cast, quantized, torch.float32)
        self._max_positions = config.max_position_embeddings

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: Sequence[BoundAttentionMetadata],
    ) -> torch.Tensor:
        """Run the decoder over one step's flattened tokens.

        Args:
            input_ids: ``[num_tokens]`` int64 token ids (requests concatenated in
                ``query_start_loc`` order).
            positions: ``[num_tokens]`` int64 position of each token in its sequence.
            kv_caches: one tensor per layer, allocated by the attention backend for the layer's
                spec (:meth:`attention_layer_specs`); layers of different KV cache groups may
                share a tensor (their block ids differ).
            attn_metadata: one :class:`BoundAttentionMetadata` per layer, built from that
                layer's KV cache group (its block table and slot mapping) for the layer's spec
                (:meth:`attention_layer_specs`: a sliding-window layer's window, a
                full-attention layer's None).

        Returns:
            ``[num_tokens, hidden_size]`` final-norm hidden states (pass the rows to sample to
            :meth:`compute_logits`).

        Raises:
            OpsInputError: not one metadata per layer, or a metadata built with another window
                than its layer's (raised before any KV is written).
        """
        num_layers = len(self.layers)
        if isinstance(attn_metadata, BoundAttentionMetadata) or len(attn_metadata) != num_layers:
            raise OpsInputError(
                f"Gemma3ForCausalLM.forward needs one attention metadata per layer ({num_layers}),"
                " each built from its layer's KV cache group"
            )
        for i, (layer, metadata) in enumerate(zip(self.layers, attn_metadata, strict=True)):
            if metadata.sliding_window != layer.sliding_window:
                raise OpsInputError(
                    f"layer {i} has sliding_window {layer.sliding_window} but its metadata was "
                    f"built with {metadata.sliding_window}"
                )
        h = self.embed_tokens(input_ids) * self.embed_scale
        global_tables = self.rotary_global.tables(positions)
        local_tables = self.rotary_local.tables(positions)
        for layer, kv_cache, metadata in zip(self.layers, kv_caches, attn_metadata, strict=True):
            cos, sin = global_tables if layer.sliding_window is None else local_tables
            h = layer(h, cos, sin, kv_cache, metadata)
        hidden = self.config.hidden_size
        return F.rms_norm(h.float(), (hidden,), self.norm, self.config.rms_norm_eps).to(self.dtype)

    __call__ = forward

    def attention_layer_specs(
        self, block_size: int, kv_cache_dtype: torch.dtype | str | None = None
    ) -> list[AttentionLayerSpec]:
        """Each layer's :class:`AttentionLayerSpec`: heads, head size, the model's dtype, its
        sliding window (None on global layers), Gemma's softmax scale
        ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``) and Gemma 2's
        ``logits_soft_cap`` (its attn_logit_softcapping; None for Gemma 3).

        Raises:
            OpsInputError: a block_size < 1 or a kv_cache_dtype the specs refuse.
        """
        windows = [layer.sliding_window for layer in self.layers]
        specs = layer_attention_specs(self.layers, windows, block_size, self.dtype, kv_cache_dtype)
        cap = self.config.attn_logit_softcapping
        if cap is None:
            return specs
        return [dataclasses.replace(spec, logits_soft_cap=cap) for spec in specs]

    @property
    def max_positions(self) -> int:
        """Positions the model runs: ``max_position_embeddings`` unless extended (the rotary
        angles are computed per forward, so any position can run)."""
        return self._max_positions

    def extend_positions(self, num_positions: int) -> None:
        """Let positions up to ``num_positions`` run (past the trained context; for an engine
        allowed a longer max_model_len). Never shrinks."""
        self._max_positions = max(self._max_positions, num_positions)

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[num_rows, vocab_size]`` float32 of hidden states ``[num_rows, hidden_size]``
        (computed in the model's dtype, then widened; ``cap * tanh(logits / cap)`` when the
        config sets final_logit_softcapping, None for Gemma 3).

        With tensor parallelism every rank must call it with the same rows (each computes its
        vocabulary shard, gathered on rank 0); the other ranks get None."""
        logits = self.lm_head(hidden_states)
        if logits is None:  # a rank other than 0: it only joined the gather
            return None
        logits = logits.float()
        if self.lm_head_weight is not None and hidden_states.shape[0] <= QUANT_MAX_TOKENS:
            refine_top_logits(logits, hidden_states, self.lm_head_weight)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
