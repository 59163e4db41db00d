"""ModelRunner: turn one scheduler step into one forward over the paged KV cache, then sample.

Per step, from the :class:`~pagedkv.worker.scheduler_output.SchedulerOutput` (requests in batch
order, each with ``num_computed_tokens`` c and ``num_scheduled_tokens`` n)::

    input_ids        [T]   the tokens all_token_ids[c : c + n] of each request, concatenated
    positions        [T]   c, c+1, ..., c+n-1 for each request
    query_start_loc  [R+1] 0, n_0, n_0+n_1, ...   (request i owns rows qsl[i] .. qsl[i+1]-1)
    seq_lens         [R]   c + n                  (tokens in the cache after this step)
    block_tables     [R, max_blocks] int32        (row i = request i's block ids; the tail of
                                                   each row is ignored: padding / stale values)
    slot_mapping     [T]   block_tables[i, pos // block_size] * block_size + pos % block_size

All of it is built with numpy over whole arrays (no Python object per token) into buffers
allocated once, then viewed as torch tensors without copies. Logits are computed only at each
request's last scheduled row, and only for requests that sample (their prompt is complete).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedkv.core.config import KVCacheConfig
from pagedkv.errors import ConfigError
from pagedkv.ops import AttentionMetadata, allocate_kv_cache
from pagedkv.worker.sampler import Sampler
from pagedkv.worker.scheduler_output import SchedulerOutput


class ModelRunner:
    """Runs the model for scheduler steps; owns the KV cache tensors and the sampler.

    Args:
        model: a model with ``forward(input_ids, positions, kv_caches, attn_metadata)`` and
            ``compute_logits(hidden)`` (:class:`pagedkv.model.llama.LlamaForCausalLM`), with
            ``config`` (ModelConfig) and ``dtype``.
        kv_cache_config: block count and layer groups; one KV cache group (all layers full
            attention, the Llama family) is supported.
        max_num_seqs: most requests per step (rows of the block-table buffer).
        max_num_batched_tokens: most tokens per step.
        max_model_len: most tokens per request (columns of the block-table buffer).
        seed: seed of the sampler's generator for requests without a seed.

    Raises:
        ConfigError: a KV cache config with more than one group.
    """

    def __init__(
        self,
        model,
        kv_cache_config: KVCacheConfig,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        seed: int = 0,
    ) -> None:
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(
                "the model runner supports one KV cache group (full attention in every layer); "
                f"got {len(kv_cache_config.kv_cache_groups)}"
            )
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        config = model.config
        self.model = model
        self.block_size = spec.block_size
        self.num_blocks = kv_cache_config.num_blocks
        self.vocab_size = config.vocab_size
        tensors = [
            allocate_kv_cache(
                self.num_blocks,
                self.block_size,
                config.num_key_value_heads,
                config.head_dim,
                model.dtype,
                model.device,
            )
            for _ in range(kv_cache_config.group_size)
        ]
        #: one KV cache tensor per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        self.kv_caches = [tensors[t] for t in kv_cache_config.tensor_ids]
        self.device = torch.device(model.device)
        self.sampler = Sampler(seed, self.device)
        self._generators: dict[str, torch.Generator] = {}

        max_blocks = -(-max_model_len // self.block_size)
        # Buffers reused by every step (numpy views shared with torch tensors).
        self._block_tables = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self._input_ids = np.zeros(max_num_batched_tokens, dtype=np.int64)
        self._arange = np.arange(max(max_num_batched_tokens, max_num_seqs) + 1, dtype=np.int64)
        self._query_start_loc = np.zeros(max_num_seqs + 1, dtype=np.int32)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache tensors."""
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in self.kv_caches}
        return sum(seen.values())

    def finish_requests(self, request_ids: Sequence[str]) -> None:
        """Forget per-request state (seeded generators) of finished requests."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def prepare_inputs(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """Build the step's flattened inputs.

        Returns:
            ``(input_ids [T] int64, positions [T] int64, attn_metadata, logits_rows)`` where
            logits_rows ``[num_sampled]`` are the rows of the sampling requests' last tokens.
        """
        num_reqs = out.num_reqs
        bs = self.block_size
        num_scheduled = np.asarray(out.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.asarray(out.num_computed_tokens, dtype=np.int64)
        qsl = self._query_start_loc[: num_reqs + 1]
        np.cumsum(num_scheduled, out=qsl[1:])
        num_tokens = int(qsl[-1])

        # Token ids: decode-only steps (the common case) take one id per request.
        input_ids = self._input_ids[:num_tokens]
        requests = out.requests
        if num_tokens == num_reqs:
            computed = out.num_computed_tokens
            input_ids[:] = [r.all_token_ids[c] for r, c in zip(requests, computed, strict=True)]
        else:
            starts = qsl.tolist()
            for i, request in enumerate(requests):
                c = out.num_computed_tokens[i]
                n = out.num_scheduled_tokens[i]
                input_ids[starts[i] : starts[i] + n] = request.all_token_ids[c : c + n]

        # Block tables: copy each row's block ids (one KV cache group).
        block_ids = [ids[0] for ids in out.block_ids]
        max_num_blocks = max(map(len, block_ids))
        block_tables = self._block_tables[:num_reqs, :max_num_blocks]
        for i, row in enumerate(block_ids):
            block_tables[i, : len(row)] = row

        # Positions and slot mapping, vectorised over all tokens.
        req_index = np.repeat(self._arange[:num_reqs], num_scheduled)
        positions = self._arange[:num_tokens] - np.repeat(qsl[:-1] - num_computed, num_scheduled)
        slot_mapping = block_tables[req_index, positions // bs].astype(np.int64)
        slot_mapping *= bs
        slot_mapping += positions % bs
        seq_lens = (num_computed + num_scheduled).astype(np.int32)

        to = self._to_device
        attn_metadata = AttentionMetadata.build(
            to(block_tables),
            to(seq_lens),
            to(qsl),
            to(slot_mapping),
            bs,
            num_blocks=self.num_blocks,
            validate=False,
        )
        logits_rows = qsl[1:][np.asarray(out.sample, dtype=bool)] - 1
        return to(input_ids), to(positions), attn_metadata, logits_rows

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A torch view of ``array`` (CPU), or a copy on the model's device."""
        tensor = torch.from_numpy(array)
        if self.device.type != "cpu":
            tensor = tensor.to(self.device, non_blocking=True)
        return tensor

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> list[int]:
        """Run one forward for the step and sample.

        Returns:
            One sampled token id per request with ``out.sample[i]`` True, in batch order.
        """
        input_ids, positions, attn_metadata, logits_rows = self.prepare_inputs(out)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, attn_metadata)
        if len(logits_rows) == 0:
            return []
        logits = self.model.compute_logits(hidden[self._to_device(logits_rows)])
        sampling = [r for r, s in zip(out.requests, out.sample, strict=True) if s]
        params = [r.sampling_params for r in sampling]
        generators = [self._generator(r) for r in sampling]
        outputs = None
        if any(p.has_penalties for p in params):
            outputs = [r.output_token_ids for r in sampling]
        return self.sampler(logits, params, generators, outputs).tolist()

    def _generator(self, request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator
