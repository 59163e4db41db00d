"""The attention ops: paged KV caches and attention over block tables.

The one door is :mod:`pagedkv.ops.backends`: pick a backend (``select_backend`` /
``get_attn_backend``), allocate each layer's cache with it, build its per-step metadata and call
its ``write_kv`` / ``forward``. Each backend's kernels are its own (docs/ops.md).
"""
