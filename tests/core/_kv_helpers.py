"""Small helpers shared by the core tests: make requests and drive them like a scheduler."""

from __future__ import annotations

from pagedkv.core import KVCacheManager, KVCacheRequest


def make_request(manager: KVCacheManager, request_id: str, token_ids: list[int], **kw):
    """A request hashed by the manager's block hasher."""
    return KVCacheRequest(request_id, list(token_ids), block_hasher=manager.block_hasher, **kw)


def admit(manager: KVCacheManager, request: KVCacheRequest):
    """Admit ``request`` with its whole prompt (hit + compute the rest), like a scheduler step.

    Returns:
        (hit tokens, new blocks or None); on success num_computed_tokens = num_tokens.
    """
    blocks, num_hit = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
    if new_blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return num_hit, new_blocks


def decode(manager: KVCacheManager, request: KVCacheRequest, token_id: int):
    """Append one generated token and give it a slot (None: no room, nothing changed except the
    token list)."""
    request.append_output_token_ids(token_id)
    new_blocks = manager.allocate_slots(request, 1)
    if new_blocks is not None:
        request.num_computed_tokens += 1
    return new_blocks


def snapshot(manager: KVCacheManager):
    """Everything that a refused call must leave unchanged, as plain values (block ids, not
    block objects), so snapshots of two managers compare too."""
    pool = manager.block_pool
    return (
        pool.num_free_blocks,
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [{h: b.block_id for h, b in m.items()} for m in pool.cached_block_hash_to_block],
        [
            {rid: [b.block_id for b in blocks] for rid, blocks in stm.req_to_blocks.items()}
            for stm in manager.coordinator.single_type_managers
        ],
    )
