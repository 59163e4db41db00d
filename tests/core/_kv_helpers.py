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


class KVContent:
    """A model of what the worker's KV cache holds: block id -> the token id written into each
    slot of the block (``None``: never written). Blocks keep stale contents when reused, as
    real KV memory does, so a read of a slot the request never wrote shows up as wrong.

    Per step: ``apply(kv.take_blocks_to_copy())`` (the worker's copies, before the step's KV
    writes), then ``write`` each scheduled request's new tokens into its slots; ``check`` reads
    every request's table back.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[int, list[int | None]] = {}

    def _block(self, block_id: int) -> list[int | None]:
        return self.blocks.setdefault(block_id, [None] * self.block_size)

    def apply(self, blocks_to_copy) -> None:
        """Copy each (src, dst) block, group by group, in order."""
        for copies in blocks_to_copy:
            for src, dst in copies:
                assert src != dst and 0 not in (src, dst)
                self.blocks[dst] = list(self._block(src))

    def write(
        self,
        kv: KVCacheManager,
        request: KVCacheRequest,
        start: int,
        end: int,
        draft_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        """Write tokens ``start .. end - 1`` of ``request`` into its slots in every group;
        positions past ``all_token_ids`` take ``draft_token_ids`` (speculative decoding)."""
        block_size = self.block_size
        tokens = request.all_token_ids + list(draft_token_ids)
        for table in kv.get_block_ids(request.request_id):
            for position in range(start, end):
                block_id = table[position // block_size]
                assert block_id != 0, f"{request.request_id} writes position {position} to null"
                self._block(block_id)[position % block_size] = tokens[position]

    def check_cached(self, kv: KVCacheManager, tokens_of_hash: dict) -> None:
        """Every block in the prefix cache (held or free) holds exactly the verified tokens its
        hash was computed from (``tokens_of_hash``: block hash -> token ids): no draft token,
        no stale slot."""
        for cached in kv.block_pool.cached_block_hash_to_block:
            for block_hash, block in cached.items():
                expected = list(tokens_of_hash[block_hash])
                got = self._block(block.block_id)
                assert got == expected, (
                    f"cached block {block.block_id} holds {got}, its hash is of {expected}"
                )

    def check(self, kv: KVCacheManager, request: KVCacheRequest) -> None:
        """Every computed token of ``request`` reads back from its own slots (the null block
        only where a sliding window has left the positions behind)."""
        block_size = self.block_size
        num_computed = request.num_computed_tokens
        for spec, table in zip(
            kv.kv_cache_specs, kv.get_block_ids(request.request_id), strict=True
        ):
            window = getattr(spec, "sliding_window", None)
            for position in range(num_computed):
                block_id = table[position // block_size]
                if block_id == 0:
                    assert window is not None, "null block in a full-attention table"
                    first_live = num_computed - window + 1
                    assert (position // block_size + 1) * block_size <= first_live
                    continue
                got = self._block(block_id)[position % block_size]
                assert got == request.all_token_ids[position], (
                    f"{request.request_id} position {position}: block {block_id} holds {got}, "
                    f"expected {request.all_token_ids[position]}"
                )
