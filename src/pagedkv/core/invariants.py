"""Consistency checks of a KVCacheManager's pool and block tables, for tests.

The hypothesis state machines (tests/core) call :func:`check_invariants` after every operation;
the manager itself keeps only the operations. O(blocks + table entries): never on a hot path.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.core.manager import KVCacheManager
from pagedkv.core.request import KVCacheRequest
from pagedkv.core.single_type import SlidingWindowManager
from pagedkv.errors import CacheStateError


def check_invariants(kv: KVCacheManager, requests: Iterable[KVCacheRequest] | None = None) -> None:
    """Raise CacheStateError if ``kv``'s pool or block tables are inconsistent (O(blocks +
    table entries); for tests and the hypothesis state machines, after every operation).

    Always: the pool's own invariants; every block's ref_cnt equals the number of block
    table entries holding it; no table holds a block twice; a block is held by one KV cache
    group only; the null block only in sliding-window tables.

    With ``requests`` (every request that holds blocks, between steps: each one's
    ``num_computed_tokens`` covers every slot it was given and wrote), also that no block
    has two writers. Let request ``r`` hold block ``b`` at index ``i`` with ``c_r`` computed
    tokens; ``b`` is full for ``r`` if ``c_r >= (i + 1) * block_size``, partially filled if
    ``i * block_size < c_r < (i + 1) * block_size``, and empty (slots only) otherwise:

    - a block empty for a holder has that one holder (ref_cnt 1): slots are never shared;
    - a block shared (ref_cnt > 1) and partially filled for one holder is partially filled
      for every holder, at the same index, with the same ``c`` (nobody wrote past the fork
      point) and the same first ``c`` token ids (so the same KV): the next writer must
      copy it, and no holder can write into it in place while another holds it;
    - each holder of such a block is in its group manager's ``may_copy`` (the requests whose
      allocations look at ref counts);
    - each table covers its request's computed tokens, and holds the null block only at
      indices wholly before the sliding window of token ``c_r``;
    - a block with a hash (in the prefix cache) at index ``i`` of ``r``'s table is full of
      computed, verified tokens (``(i + 1) * block_size <= c_r`` and ``i <`` the number of
      full blocks of ``all_token_ids``) and its hash is ``r.block_hashes[i]``: no draft token
      (speculative decoding) and no slot still to write is ever cached.

    Raises:
        CacheStateError: the first inconsistency found (with ``requests``: also a request
            that holds blocks but is not among them).
    """
    kv.block_pool.check_invariants()
    if kv.offloader is not None:
        kv.offloader.check_invariants()
    managers = kv.coordinator.single_type_managers
    ref_cnts: dict[int, int] = {}
    group_of: dict[int, int] = {}
    for group_id, manager in enumerate(managers):
        for request_id, blocks in manager.req_to_blocks.items():
            seen: set[int] = set()
            for block in blocks:
                if block.is_null:
                    if not isinstance(manager, SlidingWindowManager):
                        raise CacheStateError(
                            f"request {request_id!r} holds the null block in full-attention "
                            f"group {group_id}"
                        )
                    continue
                block_id = block.block_id
                if block_id in seen:
                    raise CacheStateError(f"request {request_id!r} holds block {block_id} twice")
                seen.add(block_id)
                if group_of.setdefault(block_id, group_id) != group_id:
                    raise CacheStateError(f"block {block_id} is held in two KV cache groups")
                ref_cnts[block_id] = ref_cnts.get(block_id, 0) + 1
    for block in kv.block_pool.blocks:
        if block.is_null:
            continue
        if block.ref_cnt != ref_cnts.get(block.block_id, 0):
            raise CacheStateError(
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held "
                f"{ref_cnts.get(block.block_id, 0)} times"
            )
    if requests is not None:
        by_id = {request.request_id: request for request in requests}
        _check_writers(kv, by_id)
        _check_cached_blocks(kv, by_id)


def _check_writers(kv: KVCacheManager, requests: dict[str, KVCacheRequest]) -> None:
    """The ``requests`` part of :func:`check_invariants`."""
    block_size = kv.block_size
    for group_id, manager in enumerate(kv.coordinator.single_type_managers):
        # block id -> (index, num_computed_tokens, request) of the holder that has it
        # partially filled (the first one met)
        partial: dict[int, tuple[int, int, KVCacheRequest]] = {}
        shared_full: set[int] = set()
        for request_id, blocks in manager.req_to_blocks.items():
            request = requests.get(request_id)
            if request is None:
                raise CacheStateError(f"request {request_id!r} holds blocks but was not given")
            num_computed = request.num_computed_tokens
            if len(blocks) * block_size < num_computed:
                raise CacheStateError(
                    f"request {request_id!r}: {len(blocks)} blocks in group {group_id} do "
                    f"not cover its {num_computed} computed tokens"
                )
            num_dead = (
                manager.num_skipped_blocks(num_computed)
                if isinstance(manager, SlidingWindowManager)
                else 0
            )
            for index, block in enumerate(blocks):
                if block.is_null:
                    if index >= num_dead:
                        raise CacheStateError(
                            f"request {request_id!r} holds the null block at index {index} "
                            f"of group {group_id}, inside its window"
                        )
                    continue
                start = index * block_size
                if num_computed <= start:  # slots only
                    if block.ref_cnt != 1:
                        raise CacheStateError(
                            f"block {block.block_id} holds no computed token of request "
                            f"{request_id!r} but is shared (ref_cnt {block.ref_cnt})"
                        )
                elif block.ref_cnt > 1:
                    block_id = block.block_id
                    if num_computed >= start + block_size:
                        shared_full.add(block_id)
                        if block_id in partial:
                            raise CacheStateError(
                                f"block {block_id} is full for request {request_id!r} but "
                                "partially filled for another holder: two writers"
                            )
                        continue
                    if block_id in shared_full:
                        raise CacheStateError(
                            f"block {block_id} is partially filled for request "
                            f"{request_id!r} but full for another holder: two writers"
                        )
                    if request_id not in manager.may_copy:
                        raise CacheStateError(
                            f"request {request_id!r} shares block {block_id} partially "
                            "filled but is not in may_copy: it would write without a copy"
                        )
                    first = partial.setdefault(block_id, (index, num_computed, request))
                    if first[0] != index or first[1] != num_computed:
                        raise CacheStateError(
                            f"block {block_id} is shared partially filled at index {index} "
                            f"with {num_computed} computed tokens by {request_id!r} and at "
                            f"index {first[0]} with {first[1]} by {first[2].request_id!r}: "
                            "two writers"
                        )
                    if (
                        request.all_token_ids[:num_computed]
                        != first[2].all_token_ids[:num_computed]
                    ):
                        raise CacheStateError(
                            f"block {block_id} is shared partially filled by "
                            f"{request_id!r} and {first[2].request_id!r}, whose first "
                            f"{num_computed} token ids differ"
                        )


def _check_cached_blocks(kv: KVCacheManager, requests: dict[str, KVCacheRequest]) -> None:
    """Every block with a hash in a request's table is one of its computed, verified blocks,
    with the request's own hash for that index (when the request hashes its blocks)."""
    block_size = kv.block_size
    for group_id, manager in enumerate(kv.coordinator.single_type_managers):
        for request_id, blocks in manager.req_to_blocks.items():
            request = requests[request_id]
            num_computed = request.num_computed_tokens
            hashes = request.block_hashes if request.block_hasher is not None else None
            for index, block in enumerate(blocks):
                block_hash = block.block_hash
                if block_hash is None or block.is_null:
                    continue
                if (index + 1) * block_size > num_computed or (
                    hashes is not None and (index >= len(hashes) or hashes[index] != block_hash)
                ):
                    raise CacheStateError(
                        f"block {block.block_id} at index {index} of request {request_id!r} "
                        f"(group {group_id}) is in the prefix cache but is not one of its "
                        f"computed, verified blocks ({num_computed} computed tokens, "
                        f"{len(request.block_hashes)} hashed blocks) or has another hash: a "
                        "draft token or an unwritten slot would be cached"
                    )


__all__ = ["check_invariants"]
