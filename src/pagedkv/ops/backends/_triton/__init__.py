"""The triton backend's own kernels (:class:`~pagedkv.ops.backends.TritonBackend`; optional
``gpu`` extra, ``pip install 'pagedkv[gpu]'``). Private: only the triton backend imports them
(and the tests and benchmarks of the kernels).

- ``cache.write_kv_triton``: the slot-mapped cache write.
- ``attention.paged_attention_triton``: a split-context decode kernel and a varlen causal prefill
  kernel reading K/V through block tables (GQA, sliding window, fp16/bf16/fp32, fp8 KV with
  per-tensor scales).
- ``config.TritonAttentionConfig``: their tile sizes.

This package imports nothing itself; ``cache`` and ``attention`` import ``triton``, and the
backend imports them only when it writes or attends. On a machine without a GPU the kernels run
under Triton's interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is imported) on CPU
tensors; docs/gpu.md says what was verified where.
"""
