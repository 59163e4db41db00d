"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM) over a paged KV cache.

One forward runs a whole scheduler step: the tokens of every scheduled request flattened into one
``[num_tokens]`` batch (prefills, chunks of prefills and decodes mixed), with their positions.
Each attention layer writes its new K/V into the paged cache through the slot mapping and attends
over each request's blocks through the block tables, both through the step's
:class:`~pagedkv.ops.backends.BoundAttentionMetadata` (the attention backend's ``write_kv`` and
``forward``; the cache layout is the backend's business)::

    h = embed(input_ids)                                   [num_tokens, hidden]
    for each layer:
        x = rms_norm(h)
        q, k, v = split(x @ W_qkv)      (+ bias for Qwen2)
        q, k = rms_norm_q(q), rms_norm_k(k)   (per head; Qwen3 only)   q/k rotated by position
        md.write_kv(k, v -> slots);  a = md.forward(q, cache)   (block tables)
        h = h + a @ W_o                                     (residual add fused in the GEMM)
        x = rms_norm(h)
        h = h + (silu(x @ W_gate) * (x @ W_up)) @ W_down    (silu, * and + fused in the GEMMs)
    return rms_norm(h)

This is the engine's hot path, so it is written for few Python-level ops per layer: fused q/k/v
weights, oneDNN-prepacked weights with fused epilogues (:mod:`pagedkv.model.packed_linear`),
rotary tables gathered once per forward, the attention's index work done once per step
(the backend's metadata), plain Python layer objects instead of ``nn.Module`` calls. Weights
are frozen: the model only runs under ``torch.inference_mode``.

The same forward runs one rank or N (tensor parallelism, docs/parallel.md): the layers are
vLLM's parallel layers (:mod:`pagedkv.model.linear`, :mod:`pagedkv.model.vocab_parallel_embedding`),
which with ``parallel`` keep this rank's heads, MLP slice and vocabulary rows and run their own
collective (the embedding's, o_proj's and down_proj's all-reduce, the LM head's gather); without
it they are the whole PackedLinears and run none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from pagedkv.errors import OpsInputError
from pagedkv.model.config import ModelConfig
from pagedkv.model.decoder import (
    DecoderForCausalLM,
    build_layer_linears,
    layer_attention_specs,
    weights_present,
)
from pagedkv.model.kernels.cpu_quant import (
    INTERLEAVED_TYPES,
    Q8_TYPES,
    CpuQuantKernels,
    GGUFPart,
    LlamaLayerWeights,
)
from pagedkv.model.logits import refine_top_logits
from pagedkv.model.packed_linear import PackedLinear
from pagedkv.model.parallel import TensorParallelGroup
from pagedkv.model.quantization import QUANT_MAX_TOKENS, QuantizedMatmul, QuantizedWeight
from pagedkv.model.rotary import RotaryEmbedding
from pagedkv.ops.backends import AttentionLayerSpec, BoundAttentionMetadata
from pagedkv.ops.c_build import KernelUnavailableError

logger = logging.getLogger(__name__)


class LlamaDecoderLayer:
    """One pre-norm decoder layer: attention with GQA and rotary, then a SwiGLU MLP.

    Under tensor parallelism (``parallel``) it holds this rank's heads and MLP slice: q/k/v and
    gate/up are column parallel, o_proj and down_proj row parallel (each all-reduces its output,
    the residual add fused into rank 0's GEMM); the forward is the same.
    """

    __slots__ = (
        "down_proj",
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
        "q_norm",
        "qkv_proj",
        "rotary",
        "scale",
        "up_proj",
    )

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        prefix: str,
        rotary: RotaryEmbedding,
        pack: str,
        parallel: TensorParallelGroup | None = None,
        quantized: Mapping[str, QuantizedWeight] | None = None,
    ):
        build_layer_linears(self, config, weights, prefix, pack, parallel, quantized)
        attn = prefix + "self_attn."
        self.input_norm = weights[prefix + "input_layernorm.weight"]
        self.post_attention_norm = weights[prefix + "post_attention_layernorm.weight"]
        self.scale = config.head_dim**-0.5
        self.rotary = rotary
        #: Qwen3's per-head q and k RMSNorm weights ``[head_dim]`` (None: no q/k norm)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = weights[attn + "q_norm.weight"]
            self.k_norm = weights[attn + "k_norm.weight"]

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: BoundAttentionMetadata,
    ) -> torch.Tensor:
        """Residual stream ``h`` ``[num_tokens, hidden]`` in, updated residual stream out (the
        same on every rank under tensor parallelism: o_proj and down_proj sum the ranks')."""
        num_tokens = h.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        x = F.rms_norm(h, (self.hidden_size,), self.input_norm, self.eps)
        qkv = self.qkv_proj(x).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        qk = qkv[:, :num_qk_heads]
        if self.q_norm is not None:
            qk = qk_rms_norm(qk, self.num_heads, self.q_norm, self.k_norm, self.eps)
        qk = self.rotary.apply(qk, cos, sin)
        k, v = qk[:, self.num_heads :], qkv[:, num_qk_heads:]
        attn_metadata.write_kv(k, v, kv_cache)
        attn = attn_metadata.forward(qk[:, : self.num_heads], kv_cache)
        h = self.o_proj.add(attn.reshape(num_tokens, -1), h)
        x = F.rms_norm(h, (self.hidden_size,), self.post_attention_norm, self.eps)
        if self.gate_up_quant is not None and num_tokens <= QUANT_MAX_TOKENS:
            quant = self.gate_up_quant
            gate, up = quant(x, quant.kernel_dtype).chunk(2, dim=1)
            return self.down_proj.add(F.silu(gate).mul_(up), h)
        return self.down_proj.add(self.up_proj.mul(x, self.gate_proj.silu(x)), h)


#: Most tokens of a step that runs the fused C layers when the model is not batch-invariant:
#: steps of up to ``QUANT_MAX_TOKENS`` on the small steps' layers, larger ones up to this on the
#: batch-invariant layers (the same rows' bits as a decode step), beyond it torch ops around
#: dequantized tiles and torch's GEMM. Measured on a 2-core Zen 4 in bf16
#: (``benchmarks/bench_batch_invariant.py``, every step on the fused layers against none past
#: 8 tokens): 12-24 chats 1.03-1.49x the output tok/s at Llama-3.2-1B's shape, 32 0.89-1.09x,
#: 48 0.87-0.92x, a 64-token prompt 0.88-0.93x; SmolLM2-135M wins up to 64 rows.
FUSED_MAX_TOKENS = 24
#: :data:`FUSED_MAX_TOKENS` of a model whose fused products are all Q4_0 / Q4_1 interleaved by 8
#: rows (the AVX2 body's layout, :data:`~pagedkv.model.kernels.cpu_quant.INTERLEAVED_TYPES`):
#: their large steps' product is their batch-invariant one, so the fused layers cost the large
#: steps nothing in products, and speculative decoding gets steps of up to this many rows with
#: every row's decode bits (64 chats, or 16 with 3 drafts each). SmolLM2-135M already ran faster
#: on the fused layers up to 64 rows on a Zen 4 (above); the interleaved layout measured in
#: docs/perf.md, 2026-12-07 "Q4_0 / Q4_1 interleaved by 8 rows".
FUSED_MAX_TOKENS_INTERLEAVED = 64


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama-family causal LM over a paged KV cache (see the module docstring).

    Args:
        config: the model's shape.
        weights: Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight``, ...),
            any float dtype; ``lm_head.weight`` may be absent when the embeddings are tied.
        dtype: compute dtype (``torch.float32`` or ``torch.bfloat16``).
        device: where the weights live.
        parallel: this rank's tensor-parallel group (:mod:`pagedkv.model.parallel`): the model
            keeps its shard only (heads, MLP slice, vocabulary rows) and runs the collectives;
            None = the whole model in this process.
        quantized: linear weights also held quantized, by the same names (``lm_head.weight``
            for a tied head too; :mod:`pagedkv.model.quantization`): steps of at most
            ``QUANT_MAX_TOKENS`` tokens run them. One rank only.

    Raises:
        ModelLoadError: a missing weight or an unsupported dtype.
        ConfigError: a model that does not split ``parallel.world_size`` ways, or quantized
            weights with tensor parallelism.
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
        super().__init__(config, weights, dtype, device, parallel)
        parallel, pack, cast = self.parallel, self.pack, self.cast(weights)
        # the fused path's fp32 tables, and this model's cast from them
        rotary32 = RotaryEmbedding(config, torch.float32, self.device)
        self.rotary = rotary32 if dtype == torch.float32 else rotary32.cast(dtype)
        with weights_present():
            self.layers = [
                LlamaDecoderLayer(
                    config, cast, f"model.layers.{i}.", self.rotary, pack, parallel, quantized
                )
                for i in range(config.num_hidden_layers)
            ]
            self.norm = cast["model.norm.weight"]
        #: the lm_head's plain weight, read by :meth:`compute_logits` to recompute the top
        #: logits in fp32 (None in fp32, unless the head is quantized, and with tensor
        #: parallelism; the embeddings when tied; when untied, a copy beside the packed one:
        #: vocab_size x hidden_size more)
        self.build_embedding_and_head(cast, quantized, dtype)
        #: each layer's weights for pagedkv's fused small-step layer (decode_layer.c), or None
        #: where the layers run as torch ops (see :func:`fused_layer_weights`)
        self.fused_layers, self._kernels, why = fused_layer_weights(
            self.layers, config, dtype, parallel
        )
        #: why the layers run as torch ops ("" where they are fused)
        self._fused_why = why
        #: most tokens of a step on the fused layers (when not batch-invariant):
        #: :data:`FUSED_MAX_TOKENS_INTERLEAVED` where every fused product is interleaved, else
        #: :data:`FUSED_MAX_TOKENS`
        self.fused_max_tokens = (
            FUSED_MAX_TOKENS_INTERLEAVED
            if self.fused_layers is not None and self._all_products_interleaved()
            else FUSED_MAX_TOKENS
        )
        if parallel is None or parallel.rank == 0:
            logger.info(
                "steps of <= %d tokens: %s",
                self.fused_max_tokens,
                "fused decoder layers (pagedkv's C layers, one call a step with a C backend"
                + (f"; weights quantized at load: <= {QUANT_MAX_TOKENS})" if quantized else ")")
                if why == ""
                else f"decoder layers as torch ops ({why})",
            )
        #: the fused path's fp32 rotary tables and final norm weight (the model's own in fp32;
        #: a bf16 model's fused steps keep their residual stream in fp32)
        self._rotary32 = self.rotary
        self._norm32 = self.norm
        if self.fused_layers is not None and dtype != torch.float32:
            self._rotary32 = rotary32
            self._norm32 = self.norm.float()
        #: the fused layers as one C array, for a backend with C entry points (one call a step)
        self._fused_layer_array = (
            None if self.fused_layers is None else self._kernels.layer_array(self.fused_layers)
        )
        # the last step's attention entry points and their C array (the same while the caches
        # and the step's metadata buffers stay put)
        self._attention_entries: tuple | None = None
        self._attention_array = None
        # the fused layers in the batch-invariant products' form, and their C array (made
        # on the first batch-invariant step; they share the weights)
        self._bi_layers: list[LlamaLayerWeights] | None = None
        self._invariant_layer_array = None
        # why they have no such form (an int4 product made at load), once tried; None: not
        # tried, or they have it
        self._bi_missing: str | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: BoundAttentionMetadata | Sequence[BoundAttentionMetadata],
    ) -> torch.Tensor:
        """Run the decoder over one step's flattened tokens.

        Args:
            input_ids: ``[num_tokens]`` int64 token ids (requests concatenated in
                ``query_start_loc`` order).
            positions: ``[num_tokens]`` int64 position of each token in its sequence
                (< :attr:`max_positions`).
            kv_caches: one tensor per layer, allocated by the attention backend
                (``backend.allocate_kv_cache(num_blocks, spec)`` with the layer's spec from
                :meth:`attention_layer_specs`); this step's K/V are written into it.
            attn_metadata: the step's :class:`BoundAttentionMetadata` for every layer, or one
                per layer (the model runner's form, shared with Gemma 3; built for the layers'
                specs: :func:`pagedkv.ops.backends.bind_metadata`).

        Returns:
            ``[num_tokens, hidden_size]`` final-norm hidden states (pass the rows to sample to
            :meth:`compute_logits`).
        """
        if self.batch_invariant:
            return self._fused_forward(input_ids, positions, kv_caches, attn_metadata, True)
        num_tokens = input_ids.shape[0]
        if self.fused_layers is not None and num_tokens <= self.fused_max_tokens:
            # a mid-size step takes the batch-invariant layers (any size); a small one the
            # small steps' (the same products for the int8 types, fewer passes for the rest)
            mid = num_tokens > QUANT_MAX_TOKENS
            if not mid or self._has_invariant_layers():
                out = self._fused_forward(input_ids, positions, kv_caches, attn_metadata, mid)
                if out is not None:
                    return out
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(positions)
        for layer, kv_cache, metadata in zip(
            self.layers, kv_caches, self._per_layer(attn_metadata), strict=True
        ):
            h = layer(h, cos, sin, kv_cache, metadata)
        return F.rms_norm(h, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)

    __call__ = forward

    def _fused_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: BoundAttentionMetadata | Sequence[BoundAttentionMetadata],
        invariant: bool = False,
    ) -> torch.Tensor | None:
        """:meth:`forward` through the fused layers: per layer one C call before attention
        (norm, q/k/v product, rotary), the backend's write and attention, one C call after (o
        product and residual, norm, MLP and residual). With a backend that has C entry points
        (``native``) the whole stack is one C call that calls them. The residual stream is fp32
        whatever the model's dtype (a bf16 model's output is rounded to bf16 after the final
        norm). Same values as the torch ops of an fp32 model up to fp32 rounding.

        Without ``invariant``, a small step (at most ``QUANT_MAX_TOKENS`` tokens) on the small
        steps' products. None (the caller runs the torch ops) for a model not in fp32 whose
        backend has no C entry points (its Python calls take and give the model's dtype),
        unless the model is batch-invariant.

        With ``invariant`` (the batch-invariant path; and the default path's mid-size steps,
        up to :attr:`fused_max_tokens`), any number of tokens, each product in
        one reduction order per row (``CpuQuantKernels.gguf_gemm_invariant``) and the final
        RMSNorm row by row in C: with the native backend's attention (each query's keys
        reduced in fixed pieces at absolute positions), every row's bits depend on its own
        token, position and cached keys and values only.

        Raises:
            OpsInputError: a batch-invariant model not in fp32 whose backend has no C entry
                points (the engine runs native with batch_invariant).
        """
        num_tokens = input_ids.shape[0]
        per_layer = self._per_layer(attn_metadata)
        entries = self._c_attention(per_layer, kv_caches)
        if entries is None and self.dtype != torch.float32:
            if self.batch_invariant:
                raise OpsInputError(
                    "batch_invariant: a bfloat16 model's steps need an attention backend with "
                    "C entry points (native)"
                )
            return None
        kernels = self._kernels
        layers = self._invariant_layers() if invariant else self.fused_layers
        threads = torch.get_num_threads()
        h = self.embed_tokens(input_ids).float().contiguous()
        cos, sin = self._rotary32.tables(positions)  # [num_tokens, 1, head_dim], contiguous
        if entries is not None:  # the whole stack in one C call
            if entries != self._attention_entries:
                self._attention_array = kernels.attention_array(entries)
                self._attention_entries = entries
            array = self._invariant_layer_array if invariant else self._fused_layer_array
            kernels.llama_forward(array, self._attention_array, h, cos, sin, threads)
        else:
            # one q/k/v buffer for every layer: the backend copies k and v into the cache and
            # returns attention in a tensor of its own before the next layer overwrites it
            first = layers[0]
            heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
            qkv = torch.empty(num_tokens, (heads + 2 * kv_heads) * head_dim)
            q, k, v = qkv.view(num_tokens, heads + 2 * kv_heads, head_dim).split(
                (heads, kv_heads, kv_heads), dim=1
            )
            for layer, kv_cache, metadata in zip(layers, kv_caches, per_layer, strict=True):
                kernels.llama_attn_in(layer, h, cos, sin, qkv, threads)
                metadata.write_kv(k, v, kv_cache)
                attn = metadata.forward(q, kv_cache).reshape(num_tokens, -1)
                kernels.llama_attn_out(layer, h, attn.contiguous(), threads)
        # row by row in C at every size: a step of 9-24 rows (the batch-invariant layers)
        # and one of 1-8 then give a row the same bits (torch's norm vectorizes by the size)
        out = kernels.rms_norm(h, self._norm32, self.config.rms_norm_eps)
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def _fused_linears(self) -> list:
        """Every layer's linears that the fused layers compute (their ``gguf`` products)."""
        return [
            linear
            for layer in self.layers
            for linear in (
                layer.qkv_proj,
                layer.o_proj.linear,
                layer.gate_proj,
                layer.up_proj,
                layer.down_proj.linear,
            )
        ]

    def _all_products_interleaved(self) -> bool:
        """Whether every fused product's parts are of the interleaved types, and the LM head
        (which :meth:`compute_logits` takes row by row up to :attr:`fused_max_tokens`) loses
        nothing there: interleaved too, or a type whose large product is already its
        row-by-row one (not in the kernels' ``fast_large_rows``: Q8_0 on the AVX2 body), or
        not kept as stored."""
        interleaved = {t.type_id for t in INTERLEAVED_TYPES.values()}
        head = self.lm_head.linear.gguf
        fast = self._kernels.fast_large_rows if self._kernels is not None else {}
        if head is not None and any(
            p.type_id not in interleaved and p.type_id in fast for p in head.parts
        ):
            return False
        return all(
            linear.gguf is not None and all(p.type_id in interleaved for p in linear.gguf.parts)
            for linear in self._fused_linears()
        )

    def max_row_exact_tokens(self) -> int | None:
        """:attr:`fused_max_tokens` where every product of the fused layers is a GGUF type
        that meets int8 activations (``Q8_TYPES``, with the kernels' ``activations`` "q8": the
        products of 1-8 rows and the batch-invariant ones give each row its one-row bits; the
        float types' and fp32 activations' products of several rows sum otherwise), the
        layers have their batch-invariant form and the LM head is kept as stored (its rows
        taken one by one up to that size): steps of up to that many tokens compute every row
        with its decode step's bits, larger ones take the large steps' products. The attention
        must be the native backend's C entry points too (the model runner checks). None
        otherwise (see :meth:`DecoderForCausalLM.max_row_exact_tokens`)."""
        if self.batch_invariant or self.fused_layers is None or self.lm_head.linear.gguf is None:
            return None
        if self._kernels.activations != "q8" or not self._has_invariant_layers():
            return None
        for linear in self._fused_linears():
            gguf = linear.gguf
            if gguf is None or any(p.type_id not in Q8_TYPES for p in gguf.parts):
                return None
        return self.fused_max_tokens

    def batch_invariant_reason(self) -> str | None:
        """None where every step can run the batch-invariant path: fused layers (every
        product on pagedkv's kernels, float32 or bfloat16, one rank) and an LM head on them;
        else why not (see :meth:`set_batch_invariant`)."""
        if self.fused_layers is None:
            return f"its decoder layers do not run on pagedkv's C kernels ({self._fused_why})"
        if not self._has_invariant_layers():  # an int4 product made at load
            return f"its decoder layers have no batch-invariant form ({self._bi_missing})"
        if self.lm_head.linear.gguf is None:
            return "its LM head is not on pagedkv's kernels (load it with batch_invariant=True)"
        return None

    def _has_invariant_layers(self) -> bool:
        """Whether the fused layers have their batch-invariant form (not with an int4 product
        made at load); tried once."""
        if self._bi_layers is None and self._bi_missing is None:
            try:
                self._invariant_layers()
            except KernelUnavailableError as e:
                self._bi_missing = str(e)
        return self._bi_missing is None

    def _invariant_layers(self) -> list[LlamaLayerWeights]:
        """The fused layers with every product in its batch-invariant form (made once).

        Raises:
            KernelUnavailableError: a product without that form (int4 made at load).
        """
        if self._bi_layers is None:
            layers, _, _ = fused_layer_weights(
                self.layers, self.config, self.dtype, self.parallel, batch_invariant=True
            )
            array = self._kernels.layer_array(layers)
            self._bi_layers, self._invariant_layer_array = layers, array
        return self._bi_layers

    @staticmethod
    def _c_attention(
        per_layer: Sequence[BoundAttentionMetadata], kv_caches: Sequence[torch.Tensor]
    ) -> tuple | None:
        """Each layer's attention C entry points (:meth:`BoundAttentionMetadata.c_attention`),
        or None when the backend has none (the layers then call it from Python)."""
        entries = []
        for metadata, kv_cache in zip(per_layer, kv_caches, strict=True):
            entry = metadata.c_attention(kv_cache)
            if entry is None:
                return None
            entries.append(tuple(entry))
        return tuple(entries)

    def _per_layer(
        self, attn_metadata: BoundAttentionMetadata | Sequence[BoundAttentionMetadata]
    ) -> Sequence[BoundAttentionMetadata]:
        """One metadata per layer: the given sequence, or the one shared by every layer."""
        if isinstance(attn_metadata, BoundAttentionMetadata):
            return [attn_metadata] * len(self.layers)
        return attn_metadata

    def attention_layer_specs(
        self, block_size: int, kv_cache_dtype: torch.dtype | str | None = None
    ) -> list[AttentionLayerSpec]:
        """Each layer's :class:`AttentionLayerSpec` (heads, head size, the model's dtype, the
        config's sliding window, softmax scale ``head_dim ** -0.5``): what the runner allocates
        caches and builds metadata for.

        Raises:
            OpsInputError: a block_size < 1 or a kv_cache_dtype the specs refuse.
        """
        windows = self.config.layer_sliding_windows
        return layer_attention_specs(self.layers, windows, block_size, self.dtype, kv_cache_dtype)

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[num_rows, vocab_size]`` float32 of hidden states ``[num_rows, hidden_size]``.

        - Batch-invariant: the head's product row by row (each row's bits those it gets
          alone), in fp32: not rounded to the model's dtype, not refined.
        - Else, up to :attr:`fused_max_tokens` rows on a head kept as stored (a GGUF file's):
          the same product row by row, rounded to the model's dtype and widened, then the 8
          largest of each row recomputed in fp32, row by row
          (:func:`pagedkv.model.logits.refine_top_logits`): a row's logits do not depend on
          the other rows (a verification step's are its decode steps').
        - Else: computed in the model's dtype, then widened, as Hugging Face does; in bf16 /
          fp16 on one rank (and in fp32 for at most ``QUANT_MAX_TOKENS`` rows on a quantized
          head) the 8 largest of each row recomputed in fp32.

        With tensor parallelism every rank must call it with the same rows (each computes its
        vocabulary shard, gathered on rank 0); the other ranks get None."""
        head = self.lm_head.linear.gguf
        if self.batch_invariant:  # fp32 straight from the head's blocks, row by row
            return head.invariant(hidden_states)
        num_rows = hidden_states.shape[0]
        if head is not None and num_rows <= self.fused_max_tokens:
            # the rows of a step the fused layers run get the logits each gets alone (its
            # product row by row, rounded to the model's dtype, refined row by row), so a
            # verification step's rows are its decode steps' (the self-draft accepts them)
            logits = head.invariant(hidden_states).to(self.dtype).float()
            if self.lm_head_weight is not None:
                refine_top_logits(logits, hidden_states, self.lm_head_weight, row_by_row=True)
            return logits
        logits = self.lm_head(hidden_states)
        if logits is None:  # a rank other than 0: it only joined the gather
            return None
        logits = logits.float()
        if self.lm_head_weight is not None and (
            self.dtype != torch.float32 or hidden_states.shape[0] <= QUANT_MAX_TOKENS
        ):
            refine_top_logits(logits, hidden_states, self.lm_head_weight)
        return logits

    @property
    def max_positions(self) -> int:
        """Positions the rotary tables cover: ``max_position_embeddings`` unless extended."""
        return self.rotary.max_positions

    def extend_positions(self, num_positions: int) -> None:
        """Let positions up to ``num_positions`` run (rotary tables extrapolated past the
        trained context; for an engine allowed a longer max_model_len). Never shrinks."""
        self.rotary.extend(num_positions)
        if self._rotary32 is not self.rotary:
            self._rotary32.extend(num_positions)


def qk_rms_norm(
    qk: torch.Tensor, num_heads: int, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float
) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of q and k, stacked as the projection gives them.

    Args:
        qk: ``[num_tokens, num_heads + num_kv_heads, head_dim]``, q heads first.
        num_heads: the q heads.
        q_norm, k_norm: ``[head_dim]`` weights.
        eps: the norm's epsilon.

    Returns:
        A new tensor of ``qk``'s shape and dtype.
    """
    head_dim = qk.shape[-1]
    q = F.rms_norm(qk[:, :num_heads], (head_dim,), q_norm, eps)
    k = F.rms_norm(qk[:, num_heads:], (head_dim,), k_norm, eps)
    return torch.cat((q, k), dim=1)


def fused_layer_weights(
    layers: Sequence[LlamaDecoderLayer],
    config: ModelConfig,
    dtype: torch.dtype,
    parallel: TensorParallelGroup | None,
    batch_invariant: bool = False,
) -> tuple[list[LlamaLayerWeights] | None, CpuQuantKernels | None, str]:
    """Each layer's weights for pagedkv's fused small-step layer
    (:class:`~pagedkv.model.kernels.cpu_quant.LlamaLayerWeights`: per product the GGUF file's
    blocks as stored, any mix of types, or an int4 weight; norm weights, bias and Qwen3's q/k
    norms as fp32 copies), the kernels that run them, and why not where the layers run as
    torch ops (the reason is logged at start): a model in neither float32 nor bfloat16, tensor
    parallelism, a product that is not on pagedkv's kernels (a dense weight, int8), or kernels
    loaded without fused layers (``PAGEDKV_QUANT_KERNEL=products``). ``batch_invariant``:
    the layers run every product batch-invariant, for any number of rows
    (:attr:`LlamaLayerWeights.batch_invariant`; GGUF parts only).

    Returns:
        ``(layers, kernels, "")`` or ``(None, None, reason)``.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        return None, None, f"the model computes in {dtype}"
    if parallel is not None:
        return None, None, "tensor parallelism"
    fused = []
    kernels = None
    for i, layer in enumerate(layers):
        products = (
            _fused_product(layer.qkv_proj, layer.qkv_proj.quant),
            _fused_product(layer.o_proj.linear, layer.o_proj.linear.quant),
            _fused_gate_up(layer),
            _fused_product(layer.down_proj.linear, layer.down_proj.linear.quant),
        )
        names = ("q/k/v", "o", "gate/up", "down")
        for name, product in zip(names, products, strict=True):
            if product is None:
                return None, None, f"layer {i}'s {name} product is not on pagedkv's kernels"
            if not product[1].fused_layers:
                return None, None, "PAGEDKV_QUANT_KERNEL=products"
        kernels = products[0][1]

        def fp32(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.float().contiguous()

        fused.append(
            LlamaLayerWeights(
                *(weights for weights, _ in products),
                fp32(layer.input_norm),
                fp32(layer.post_attention_norm),
                fp32(layer.qkv_proj.bias),
                num_heads=layer.num_heads,
                num_kv_heads=layer.num_kv_heads,
                head_dim=layer.head_dim,
                eps=layer.eps,
                isa=kernels.isa,
                activations=kernels.activations,
                q8_isa=kernels.q8_isa,
                q_norm=fp32(layer.q_norm),
                k_norm=fp32(layer.k_norm),
                batch_invariant=batch_invariant,
            )
        )
    return fused, kernels, ""


def _fused_product(linear: PackedLinear, quant: QuantizedMatmul | None):
    """``(weights, kernels)`` of one product in the fused layer's form: the GGUF parts as
    stored (every part's type run by the kernels), or an int4 weight on pagedkv's kernels;
    None otherwise."""
    if linear.gguf is not None:
        parts = linear.gguf.parts
        kernels = parts[0].kernels
        if any(p.type_id not in kernels.gguf_types for p in parts):
            return None
        return [GGUFPart(p.type_id, p.data) for p in parts], kernels
    if quant is None or quant.kernels is None or quant.bits != 4:
        return None
    return (quant.packed, quant.scales, quant.min), quant.kernels


def _fused_gate_up(layer: LlamaDecoderLayer):
    """The gate and up products stacked for the fused layer (see :func:`_fused_product`)."""
    if layer.gate_proj.gguf is not None and layer.up_proj.gguf is not None:
        gate = _fused_product(layer.gate_proj, None)
        up = _fused_product(layer.up_proj, None)
        if gate is None or up is None:
            return None
        return gate[0] + up[0], gate[1]
    quant = layer.gate_up_quant
    if quant is None:
        return None
    return _fused_product(layer.gate_proj, quant)
