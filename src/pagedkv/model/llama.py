"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

One forward runs a whole scheduler step: the tokens of every scheduled request flattened into one
``[num_tokens]`` batch (prefills, chunks of prefills and decodes mixed), with their positions.
Each attention layer writes its new K/V into the paged cache through the slot mapping and attends
over each request's blocks through the block tables, both through the step's
:class:`~pagedkv.ops.backends.BoundAttentionMetadata` (the attention backend's ``write_kv`` and
``forward``; the cache layout is the backend's business)::

    h = embed(input_ids)                                   [num_tokens, hidden]
    for each layer:
        x = rms_norm(h)
        q, k, v = split(x @ W_qkv)      (+ bias for Qwen2)  q/k rotated by position
        write_kv(k, v -> slots);  a = paged_attention(q, cache, block tables)
        h = h + a @ W_o                                     (residual add fused in the GEMM)
        x = rms_norm(h)
        h = h + (silu(x @ W_gate) * (x @ W_up)) @ W_down    (silu, * and + fused in the GEMMs)
    return rms_norm(h)

This is the engine's hot path, so it is written for few Python-level ops per layer: fused q/k/v
weights, oneDNN-prepacked weights with fused epilogues (:mod:`pagedkv.model.packed_linear`),
rotary tables gathered once per forward, the attention's index work done once per step
(the backend's metadata), plain Python layer objects instead of ``nn.Module`` calls. Weights
are frozen: the model only runs under ``torch.inference_mode``.

With ``parallel`` (tensor parallelism, :mod:`pagedkv.model.parallel`, docs/parallel.md) each
process keeps its heads, its MLP slice and its vocabulary rows, and the layers are
:class:`TensorParallelLlamaDecoderLayer` (an all-reduce after o_proj and after down_proj).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from pagedkv.errors import ModelLoadError
from pagedkv.model.config import ModelConfig
from pagedkv.model.logits import refine_top_logits
from pagedkv.model.packed_linear import PackedLinear, linear_mode, log_linear_mode
from pagedkv.model.parallel import TensorParallelGroup, check_tensor_parallel
from pagedkv.model.rotary import RotaryEmbedding
from pagedkv.ops.backends import AttentionLayerSpec, BoundAttentionMetadata


class LlamaDecoderLayer:
    """One pre-norm decoder layer: attention with GQA and rotary, then a SwiGLU MLP."""

    __slots__ = (
        "down_proj",
        "eps",
        "gate_proj",
        "head_dim",
        "hidden_size",
        "input_norm",
        "num_heads",
        "num_kv_heads",
        "o_proj",
        "post_attention_norm",
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
    ):
        shard = _layer_sharder(config, parallel)

        def w(name: str) -> torch.Tensor:
            return shard(name, weights[prefix + name])

        attn = "self_attn."
        qkv_weight = torch.cat([w(attn + f"{p}_proj.weight") for p in "qkv"])
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([w(attn + f"{p}_proj.bias") for p in "qkv"])
        self.qkv_proj = PackedLinear(qkv_weight, qkv_bias, pack)
        self.o_proj = PackedLinear(w(attn + "o_proj.weight"), None, pack)
        self.gate_proj = PackedLinear(w("mlp.gate_proj.weight"), None, pack)
        self.up_proj = PackedLinear(w("mlp.up_proj.weight"), None, pack)
        self.down_proj = PackedLinear(w("mlp.down_proj.weight"), None, pack)
        self.input_norm = w("input_layernorm.weight")
        self.post_attention_norm = w("post_attention_layernorm.weight")
        self.eps = config.rms_norm_eps
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        if parallel is not None:
            sizes = check_tensor_parallel(config, parallel.world_size)
            self.num_heads, self.num_kv_heads = sizes.num_heads, sizes.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.rotary = rotary

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: BoundAttentionMetadata,
    ) -> torch.Tensor:
        """Residual stream ``h`` ``[num_tokens, hidden]`` in, updated residual stream out."""
        num_tokens = h.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        x = F.rms_norm(h, (self.hidden_size,), self.input_norm, self.eps)
        qkv = self.qkv_proj(x).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        qk = self.rotary.apply(qkv[:, :num_qk_heads], cos, sin)
        k, v = qk[:, self.num_heads :], qkv[:, num_qk_heads:]
        attn_metadata.write_kv(k, v, kv_cache)
        attn = attn_metadata.forward(qk[:, : self.num_heads], kv_cache)
        h = self.o_proj.add(attn.reshape(num_tokens, -1), h)
        x = F.rms_norm(h, (self.hidden_size,), self.post_attention_norm, self.eps)
        return self.down_proj.add(self.up_proj.mul(x, self.gate_proj.silu(x)), h)


class TensorParallelLlamaDecoderLayer(LlamaDecoderLayer):
    """A decoder layer's shard on one tensor-parallel rank (:mod:`pagedkv.model.parallel`):
    its query heads, its KV heads (or its replica of one), its slice of the MLP. o_proj and
    down_proj are row parallel: each rank's partial sums meet in one all-reduce each; rank 0
    alone adds the residual (fused in its GEMM, as the single-process layer) so that it is
    counted once."""

    __slots__ = ("parallel",)

    def __init__(self, config, weights, prefix, rotary, pack, parallel: TensorParallelGroup):
        super().__init__(config, weights, prefix, rotary, pack, parallel)
        self.parallel = parallel

    def __call__(self, h, cos, sin, kv_cache, attn_metadata):
        """Residual stream ``h`` ``[num_tokens, hidden]`` (the same on every rank) in, updated
        residual stream out (the same on every rank after the all-reduces)."""
        num_tokens = h.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        first = self.parallel.rank == 0
        x = F.rms_norm(h, (self.hidden_size,), self.input_norm, self.eps)
        qkv = self.qkv_proj(x).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        qk = self.rotary.apply(qkv[:, :num_qk_heads], cos, sin)
        k, v = qk[:, self.num_heads :], qkv[:, num_qk_heads:]
        attn_metadata.write_kv(k, v, kv_cache)
        attn = attn_metadata.forward(qk[:, : self.num_heads], kv_cache).reshape(num_tokens, -1)
        h = self.parallel.all_reduce(self.o_proj.add(attn, h) if first else self.o_proj(attn))
        x = F.rms_norm(h, (self.hidden_size,), self.post_attention_norm, self.eps)
        act = self.up_proj.mul(x, self.gate_proj.silu(x))
        out = self.down_proj.add(act, h) if first else self.down_proj(act)
        return self.parallel.all_reduce(out)


def _layer_sharder(config: ModelConfig, parallel: TensorParallelGroup | None):
    """``shard(name, tensor)``: this rank's part of a layer weight (the whole tensor without
    tensor parallelism). q/k/v and gate/up split by output rows (whole heads), o_proj and
    down_proj by input columns."""
    if parallel is None:
        return lambda name, tensor: tensor
    sizes = check_tensor_parallel(config, parallel.world_size)
    d, r = config.head_dim, parallel.rank
    first_kv, last_kv = parallel.kv_head_range(config.num_key_value_heads)
    rows = {
        "q": (r * sizes.num_heads * d, (r + 1) * sizes.num_heads * d),
        "k": (first_kv * d, last_kv * d),
        "v": (first_kv * d, last_kv * d),
        "gate": (r * sizes.intermediate_size, (r + 1) * sizes.intermediate_size),
        "up": (r * sizes.intermediate_size, (r + 1) * sizes.intermediate_size),
    }

    def shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
        proj = name.rsplit(".", 2)[-2].removesuffix("_proj") if "_proj." in name else None
        if proj in rows:
            start, end = rows[proj]
            return tensor[start:end].contiguous()
        if proj in ("o", "down"):
            return parallel.shard_cols(tensor).contiguous()
        return tensor

    return shard


class LlamaForCausalLM:
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

    Raises:
        ModelLoadError: a missing weight or an unsupported dtype.
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
    ):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ModelLoadError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.parallel = parallel
        #: KV heads in this process's KV cache (its share under tensor parallelism).
        self.num_kv_heads = config.num_key_value_heads
        if parallel is not None:
            self.num_kv_heads = check_tensor_parallel(config, parallel.world_size).num_kv_heads
        pack = linear_mode(self.device, dtype)
        if parallel is None or parallel.rank == 0:  # one warning, not one per rank
            log_linear_mode(pack, dtype)
        cast = _Caster(weights, dtype, self.device)
        self.rotary = RotaryEmbedding(config, dtype, self.device)
        try:
            self.embed_tokens = cast["model.embed_tokens.weight"]
            if parallel is None:
                self.layers = [
                    LlamaDecoderLayer(config, cast, f"model.layers.{i}.", self.rotary, pack)
                    for i in range(config.num_hidden_layers)
                ]
            else:
                self.layers = [
                    TensorParallelLlamaDecoderLayer(
                        config, cast, f"model.layers.{i}.", self.rotary, pack, parallel
                    )
                    for i in range(config.num_hidden_layers)
                ]
            self.norm = cast["model.norm.weight"]
            tied = config.tie_word_embeddings
            lm_head = self.embed_tokens if tied else cast["lm_head.weight"]
        except KeyError as e:
            raise ModelLoadError(f"checkpoint lacks the weight {e.args[0]!r}") from None
        if parallel is not None:  # vocab parallel (vLLM's VocabParallelEmbedding, ParallelLMHead)
            self.vocab_shard = check_tensor_parallel(config, parallel.world_size).vocab_shard
            self.vocab_start = parallel.rank * self.vocab_shard
            self.embed_tokens = parallel.shard_rows(self.embed_tokens, self.vocab_shard)
            lm_head = parallel.shard_rows(lm_head, self.vocab_shard)
        self.lm_head = PackedLinear(lm_head, None, pack)
        #: the lm_head's plain weight, read by :meth:`compute_logits` to recompute the top
        #: logits in fp32 (None in fp32 and with tensor parallelism; the embeddings when tied;
        #: when untied, a copy beside the packed one: vocab_size x hidden_size more)
        refine = dtype != torch.float32 and parallel is None
        self.lm_head_weight = lm_head if refine else None

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
        if self.parallel is None:
            h = F.embedding(input_ids, self.embed_tokens)
        else:
            h = self._parallel_embed(input_ids)
        cos, sin = self.rotary.tables(positions)
        if isinstance(attn_metadata, BoundAttentionMetadata):
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                h = layer(h, cos, sin, kv_cache, attn_metadata)
        else:
            for layer, kv_cache, metadata in zip(
                self.layers, kv_caches, attn_metadata, strict=True
            ):
                h = layer(h, cos, sin, kv_cache, metadata)
        return F.rms_norm(h, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)

    __call__ = forward

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
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_rows, vocab_size]`` float32 of hidden states ``[num_rows, hidden_size]``:
        computed in the model's dtype, then widened, as Hugging Face does; in bf16 / fp16 on one
        rank the 8 largest of each row are then recomputed in fp32
        (:func:`pagedkv.model.logits.refine_top_logits`: closer to the fp32 model).

        With tensor parallelism every rank must call it with the same rows (each computes its
        vocabulary shard, gathered on rank 0); the other ranks get None."""
        if self.parallel is None:
            logits = self.lm_head(hidden_states).float()
            if self.lm_head_weight is not None:
                refine_top_logits(logits, hidden_states, self.lm_head_weight)
            return logits
        logits = self.parallel.gather_to_first(self.lm_head(hidden_states))
        return None if logits is None else logits[:, : self.config.vocab_size].float()

    def _parallel_embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids of its shard (zeros for the others'),
        one all-reduce sums them."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_shard)
        h = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return self.parallel.all_reduce(h.masked_fill_(outside.unsqueeze(1), 0))

    @property
    def max_positions(self) -> int:
        """Positions the rotary tables cover: ``max_position_embeddings`` unless extended."""
        return self.rotary.max_positions

    def extend_positions(self, num_positions: int) -> None:
        """Let positions up to ``num_positions`` run (rotary tables extrapolated past the
        trained context; for an engine allowed a longer max_model_len). Never shrinks."""
        self.rotary.extend(num_positions)


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


class _Caster(Mapping):
    """Read-only view of a weight dict that casts each tensor to the model's dtype and device
    on access."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device):
        self._weights = weights
        self._dtype = dtype
        self._device = device

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._weights[name].to(dtype=self._dtype, device=self._device).contiguous()

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)
