"""Block-table addressing inside Triton kernels: token positions -> offsets into the paged cache.

One KV cache tensor per layer is ``[2, num_blocks, num_kv_heads, block_size, head_size]``; a
kernel gets ``kv_cache[0]`` (keys) and ``kv_cache[1]`` (values) as base pointers plus their
(block, token, head) strides. Token ``pos`` of a request lives in physical block
``block_table[pos // block_size]`` at offset ``pos % block_size``::

    positions    0 1 2 3 | 4 5 6 7 | 8 9            (block_size 4)
    block_table  [   7   ,    2    ,  9  , 0, 0]    (padded with the null block 0)
    offsets      7*sb+0*st ...      9*sb+1*st

The kernels gather one tile of positions at a time (a tile may span several blocks, or part of
one), so the tile size is independent of ``block_size``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def token_offsets(
    block_table_ptr,
    positions,
    mask,
    BLOCK_SIZE: tl.constexpr,
    stride_cache_block,
    stride_cache_token,
):
    """Offsets (int64, in elements) of ``positions`` ``[TILE]`` in one K or V cache, 0 where masked.

    ``block_table_ptr`` points at the request's row of the block table; masked positions read no
    table entry (they may lie past the row's end).
    """
    block_ids = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=mask, other=0)
    return (
        block_ids.to(tl.int64) * stride_cache_block
        + (positions % BLOCK_SIZE).to(tl.int64) * stride_cache_token
    )
