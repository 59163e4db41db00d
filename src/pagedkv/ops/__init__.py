"""Paged attention ops (torch): the KV-cache layout, the slot-mapped write and attention over
block tables, with a reference and a fast CPU implementation behind one interface."""

from pagedkv.ops.attention import paged_attention
from pagedkv.ops.attention_metadata import AttentionMetadata, PagedAttentionMetadata
from pagedkv.ops.kv_cache import allocate_kv_cache, write_kv

__all__ = [
    "AttentionMetadata",
    "PagedAttentionMetadata",
    "allocate_kv_cache",
    "paged_attention",
    "write_kv",
]
