"""Per-attention-type block managers: the blocks of one KV cache group for every request.

Full attention keeps every block of a request. Sliding window (window ``w``) frees the blocks
that have left the window and puts the null block in their place in the block table::

    block_size 4, w 8, c = 13 computed tokens: token 13 attends to tokens 6..13
    tokens:       0..3    4..7    8..11   12..15
    block table: [null]  [ b5 ]  [ b9 ]  [ b2 ]     block 0 was wholly dead, so it was freed

Fork and copy-on-write (both attention types): ``fork`` maps a child's table onto the blocks of
its parent's computed tokens; the one block that can be partially filled (the block of token
``c``, the next token to write) is shared until a holder writes into it, and that writer gets a
new block (a (src, dst) copy for the worker) while the others keep the old one::

    block_size 4, parent computed c = 6, fork:   parent [b1][b2]     child [b1][b2]   b2 ref_cnt 2
    child writes token 6 (copy-on-write):       parent [b1][b2]     child [b1][b7]   copy (2, 7)
    parent writes token 6 (b2 is now its own):  parent [b1][b2]     in place, no copy

Idea from vLLM V1 (``vllm/v1/core/single_type_kv_cache_manager.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.core.block import KVCacheBlock, PrefixNode
from pagedkv.core.block_pool import BlockPool
from pagedkv.core.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv
from pagedkv.errors import CacheStateError, ConfigError

if TYPE_CHECKING:
    from pagedkv.core.request import KVCacheRequest


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group; full-attention behaviour.

    Args:
        kv_cache_spec: the group's attention spec (its block_size is used).
        block_pool: the pool shared by all groups.
        kv_cache_group_id: index of the group (selects its prefix-cache map).
    """

    #: A hit of n blocks implies hits of every shorter length (so hits can be truncated).
    prefix_closed = True

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self._cached = block_pool.cached_block_hash_to_block[kv_cache_group_id]
        self._null_block = block_pool.null_block
        # With a non-cryptographic hash every hit is checked against PrefixNodes; the node of
        # each request's last cached block is the parent of its next one.
        self._verify = block_pool.keep_token_ids
        self._prefix_tail: dict[str, PrefixNode] = {}
        # Copy-on-write copies (src block id, dst block id) not yet taken by the scheduler.
        self.blocks_to_copy: list[tuple[int, int]] = []
        #: Requests that may hold a shared, partially filled block: both sides of every fork
        #: made off a block boundary, until they write past it or are freed. Only sharing by
        #: ``fork`` can make such a block (prefix hits share full blocks only), so ``grow``
        #: looks at ref counts for these requests only: an empty set costs one truth test.
        self.may_copy: set[str] = set()
        #: Copies recorded since the manager was made (only grows).
        self.num_blocks_copied = 0

    def shared_partial_block(
        self, blocks: list[KVCacheBlock] | None, num_tokens: int, num_computed_tokens: int
    ) -> KVCacheBlock | None:
        """The block that a write of tokens ``num_computed_tokens ..`` would have to copy first:
        the block of token ``c = num_computed_tokens`` if it already holds tokens (``c`` is not a
        multiple of block_size), is held by another request too (ref_cnt > 1) and the request
        gets slots past ``c`` (``num_tokens > c``); else ``None``. O(1).
        """
        block_size = self.block_size
        if blocks and num_computed_tokens % block_size and num_tokens > num_computed_tokens:
            index = num_computed_tokens // block_size
            if index < len(blocks) and blocks[index].ref_cnt > 1:
                return blocks[index]
        return None

    def _copy_on_write(self, blocks: list[KVCacheBlock], index: int, dst: KVCacheBlock) -> None:
        """Point ``blocks[index]`` (shared, ref_cnt > 1) at ``dst`` and record the copy."""
        src = blocks[index]
        blocks[index] = dst
        src.ref_cnt -= 1  # > 1 before: another request still holds it, it stays out of the queue
        self.blocks_to_copy.append((src.block_id, dst.block_id))
        self.num_blocks_copied += 1

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The (src block id, dst block id) copies recorded since the last call, in order."""
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Give ``child_id`` (holding nothing) the parent's blocks of its first
        ``num_computed_tokens`` tokens, one more reference each (null blocks stay null).

        The caller (``KVCacheManager.fork``) has checked that the parent's table covers them.
        Returns the child's block table.
        """
        blocks = self.req_to_blocks[parent_id][: cdiv(num_computed_tokens, self.block_size)]
        self._drop_dead_blocks(blocks, num_computed_tokens)
        self.block_pool.touch(blocks)
        self.req_to_blocks[child_id] = blocks
        num_cached = self.num_cached_block.get(parent_id, 0)
        limit = num_computed_tokens // self.block_size
        self.num_cached_block[child_id] = num_cached if num_cached <= limit else limit
        tail = self._prefix_tail.get(parent_id)
        if tail is not None and num_cached <= limit:
            self._prefix_tail[child_id] = tail
        if num_computed_tokens % self.block_size:
            self.may_copy.add(parent_id)
            self.may_copy.add(child_id)
        return blocks

    def _drop_dead_blocks(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Replace the blocks no future token attends to by the null block (in a fork's new
        table, before it takes references); none for full attention."""

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
    ) -> int:
        """Net free blocks that ``allocate_slots`` would take for this group.

        Args:
            num_tokens: tokens the request will have slots for (computed + new + lookahead).
            new_computed_blocks: cache hits about to be added (ref_cnt 0 ones leave the queue).
            num_computed_tokens: computed tokens after this call's hits (for window freeing).
        """
        blocks = self.req_to_blocks.get(request_id)
        num_new = cdiv(num_tokens, self.block_size) - len(new_computed_blocks)
        if blocks:
            num_new -= len(blocks)
        if num_new < 0:
            num_new = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_new += 1
        if self.shared_partial_block(blocks, num_tokens, num_computed_tokens) is not None:
            num_new += 1  # copy-on-write of the shared, partially filled block
        return num_new

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no future token can attend to (none for full attention)."""

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Start the request's block table with its (already touched) cache hits.

        Raises:
            CacheStateError: the request already holds blocks in this group (the manager checks
                this before changing anything).
        """
        if self.req_to_blocks.get(request_id):
            raise CacheStateError(
                f"request {request_id!r} already holds blocks; hits are for new ones"
            )
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)
        if self._verify and new_computed_blocks:
            self._prefix_tail[request_id] = new_computed_blocks[-1].prefix

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_computed_tokens: int = 0
    ) -> list[KVCacheBlock]:
        """Grow the block table to cover ``num_tokens`` tokens; return the new blocks.

        If the block of token ``num_computed_tokens`` is partially filled and shared (a fork),
        it is first replaced by a new block (copy-on-write, recorded in ``blocks_to_copy``); that
        block is taken from the pool before the new ones and is not among those returned (it
        replaces an entry; the returned blocks are appended at the end of the table).
        """
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new < 0:
            num_new = 0
        shared = self.shared_partial_block(blocks, num_tokens, num_computed_tokens)
        if self.may_copy and num_tokens > num_computed_tokens:
            self.may_copy.discard(request_id)  # after this write no block of it is shared unfilled
        if shared is None:
            if num_new == 0:
                return []
            new_blocks = self.block_pool.get_new_blocks(num_new)
        else:
            new_blocks = self.block_pool.get_new_blocks(num_new + 1)
            self._copy_on_write(blocks, num_computed_tokens // self.block_size, new_blocks[0])
            del new_blocks[0]
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Put the request's blocks that are full within its first ``num_tokens`` tokens (and
        hashed) into the prefix cache."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = num_tokens // self.block_size
        num_hashes = len(request.block_hashes)
        if num_full > num_hashes:
            num_full = num_hashes
        if num_full <= num_cached:
            return
        tail = self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
            self._prefix_tail.get(request_id),
        )
        if tail is not None:
            self._prefix_tail[request_id] = tail
        self.num_cached_block[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first (a chain's tail is evicted before its
        prefix). A request that holds nothing is a no-op."""
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks is None:
            return
        self.num_cached_block.pop(request_id, None)
        self._prefix_tail.pop(request_id, None)
        if self.may_copy:
            self.may_copy.discard(request_id)
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (empty if it holds nothing). Do not mutate."""
        return self.req_to_blocks.get(request_id, [])

    def find_longest_cache_hit(
        self, request: KVCacheRequest, max_length: int
    ) -> list[KVCacheBlock]:
        """Longest run of cached blocks from the start of the request, at most
        ``max_length // block_size`` blocks.

        With a non-cryptographic hash each hit is checked walking from block 0: block ``i``'s
        :class:`PrefixNode` must hold the request's tokens and extra keys of block ``i`` and
        have the node matched for block ``i - 1`` as its parent (``None`` for block 0), so the
        hit's KV was computed after exactly the request's prefix, whatever the hash says.
        """
        block_size = self.block_size
        hashes = request.block_hashes
        num_blocks = min(max_length // block_size, len(hashes))
        get = self._cached.get
        hit: list[KVCacheBlock] = []
        if self._verify:
            tokens = request.all_token_ids
            extra_keys = _extra_keys_of(request)
            parent = None
            for i in range(num_blocks):
                block = get(hashes[i])
                if block is None:
                    break
                node = block.prefix
                start = i * block_size
                if (
                    node is None
                    or node.parent is not parent
                    or node.token_ids != tokens[start : start + block_size]
                    or node.extra_keys != (b"" if extra_keys is None else extra_keys(request, i))
                ):
                    break
                hit.append(block)
                parent = node
            return hit
        append = hit.append
        for i in range(num_blocks):
            block = get(hashes[i])
            if block is None:
                break
            append(block)
        return hit


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full (causal) attention: every block of a request stays until it finishes."""

    def grow(
        self, request: KVCacheRequest, num_tokens_need_slot: int, num_tokens_to_cache: int
    ) -> Sequence[KVCacheBlock] | None:
        """Check-then-allocate in one pass for a request without new prefix hits (decode steps,
        prefill chunks): the hot path of a one-group model.

        Args:
            num_tokens_need_slot: tokens the request must have slots for.
            num_tokens_to_cache: tokens whose full blocks enter the prefix cache (-1: no caching);
                blocks without a hash yet (``request.block_hashes`` too short) are skipped.

        Copy-on-write as in ``allocate_new_blocks``, O(1): for a request in ``may_copy`` (a side
        of a fork not yet written past it) one look at the ref_cnt of the block of token
        ``request.num_computed_tokens``; for the others (every request when nothing was forked)
        one set test; nothing per token.

        Returns:
            The new blocks (a list, or ``()`` if none), or ``None`` if they do not fit (nothing
            changed).
        """
        request_id = request.request_id
        block_size = self.block_size
        blocks = self.req_to_blocks.get(request_id)
        num_new = (num_tokens_need_slot + block_size - 1) // block_size
        pool = self.block_pool
        if blocks is not None:
            num_new -= len(blocks)
            if self.may_copy and request_id in self.may_copy:
                return self._grow_forked(
                    request, blocks, num_tokens_need_slot, num_new, num_tokens_to_cache
                )
        if num_new > 0:
            if num_new > pool.free_block_queue.num_free_blocks:
                return None
            new_blocks = pool.get_new_blocks(num_new)
            if blocks is None:
                self.req_to_blocks[request_id] = blocks = new_blocks.copy()
            else:
                blocks.extend(new_blocks)
        else:
            new_blocks = ()
            if blocks is None:
                self.req_to_blocks[request_id] = blocks = []
        if num_tokens_to_cache >= block_size:
            num_full = num_tokens_to_cache // block_size
            num_hashes = len(request.block_hashes)
            if num_full > num_hashes:
                num_full = num_hashes
            num_cached = self.num_cached_block.get(request_id, 0)
            if num_full > num_cached:
                tail = pool.cache_full_blocks(
                    request,
                    blocks,
                    num_cached,
                    num_full,
                    block_size,
                    self.kv_cache_group_id,
                    self._prefix_tail.get(request_id) if self._verify else None,
                )
                if tail is not None:
                    self._prefix_tail[request_id] = tail
                self.num_cached_block[request_id] = num_full
        return new_blocks

    def _grow_forked(
        self,
        request: KVCacheRequest,
        blocks: list[KVCacheBlock],
        num_tokens_need_slot: int,
        num_new: int,
        num_tokens_to_cache: int,
    ) -> list[KVCacheBlock] | None:
        """``grow`` for a request in ``may_copy``: copy-on-write of its shared partially filled
        block first, as ``allocate_new_blocks`` does (the copy's block is taken before the new
        ones), so both paths hand out the same blocks. ``num_new``: blocks past the table's end
        (may be negative)."""
        pool = self.block_pool
        num_computed_tokens = request.num_computed_tokens
        shared = self.shared_partial_block(blocks, num_tokens_need_slot, num_computed_tokens)
        if num_new < 0:
            num_new = 0
        num_needed = num_new if shared is None else num_new + 1
        if num_needed > pool.free_block_queue.num_free_blocks:
            return None
        # Checked: from here on everything succeeds.
        new_blocks = pool.get_new_blocks(num_needed) if num_needed else []
        if shared is not None:
            self._copy_on_write(blocks, num_computed_tokens // self.block_size, new_blocks[0])
            del new_blocks[0]
        blocks.extend(new_blocks)
        if num_tokens_need_slot > num_computed_tokens:
            self.may_copy.discard(request.request_id)  # no block of it is shared unfilled now
        self.cache_blocks(request, num_tokens_to_cache)
        return new_blocks


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: a token at position ``p`` attends to ``p - w + 1 .. p``.

    After ``c`` computed tokens the next token is ``c``, so tokens before ``c - w + 1`` are dead;
    wholly dead blocks are freed and replaced by the null block.
    """

    prefix_closed = False

    def __init__(
        self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window
        # A hit ending at token L must keep tokens L - w + 1 .. L - 1 (w - 1 tokens): that many
        # blocks at its end (at least one, so a hit is never made of null blocks only).
        self.num_contiguous_blocks = max(1, cdiv(self.sliding_window - 1, self.block_size))

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks wholly before the window of the next token (position c)."""
        first_live = num_computed_tokens - self.sliding_window + 1
        return first_live // self.block_size if first_live > 0 else 0

    def _skippable(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> range:
        # Dead blocks not yet replaced by the null block: the nulls form a prefix, so walk back.
        last = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        first = last
        null = self._null_block
        while first > 0 and blocks[first - 1] is not null:
            first -= 1
        return range(last - 1, first - 1, -1)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
    ) -> int:
        num_new = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, num_computed_tokens
        )
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            # Blocks that remove_skipped_blocks will give back (those only this request holds).
            for i in self._skippable(blocks, num_computed_tokens):
                if blocks[i].ref_cnt == 1:
                    num_new -= 1
        return num_new

    def _drop_dead_blocks(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        null = self._null_block
        for i in range(min(self.num_skipped_blocks(num_computed_tokens), len(blocks))):
            blocks[i] = null

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks that left the window; the table keeps the null block in their place.
        Calling it again at the same ``num_computed_tokens`` frees nothing."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        removed = []
        null = self._null_block
        for i in self._skippable(blocks, num_computed_tokens):
            removed.append(blocks[i])
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def find_longest_cache_hit(
        self, request: KVCacheRequest, max_length: int
    ) -> list[KVCacheBlock]:
        """Longest hit (at most ``max_length // block_size`` blocks) whose last
        ``num_contiguous_blocks`` blocks are cached; the blocks before them are null blocks
        (their tokens are outside the window of every token still to compute).

        With a non-cryptographic hash the scan (from the end) checks each candidate block's
        :class:`PrefixNode` against the request's block, each block of a run against the next
        one's parent, and the run's first block's parent chain against the request's blocks
        before it down to block 0: the KV of a sliding-window layer still depends on the whole
        prefix (through the layers below), so a block that holds the request's tokens after
        another prefix is a miss.
        """
        block_size = self.block_size
        hashes = request.block_hashes
        num_blocks = min(max_length // block_size, len(hashes))
        hit = [self._null_block] * num_blocks
        need = self.num_contiguous_blocks
        get = self._cached.get
        match = _matcher(request, block_size) if self._verify else None
        num_contiguous = 0
        for i in range(num_blocks - 1, -1, -1):
            block = get(hashes[i])
            if block is not None and match is not None:
                node = block.prefix
                if node is None or not match(node, i):
                    block = None
                elif num_contiguous and hit[i + 1].prefix.parent is not node:
                    num_contiguous = 0  # block i + 1 was computed after another block i
            if block is None:
                num_contiguous = 0
                continue
            hit[i] = block
            num_contiguous += 1
            if num_contiguous >= need:
                if match is not None and not _chain_matches(match, block.prefix.parent, i - 1):
                    num_contiguous = 0  # no run through block i can be valid
                    continue
                del hit[i + num_contiguous :]
                return hit
        # No long enough run: only a run that starts at block 0 is a valid (short) hit.
        if match is not None and num_contiguous and hit[0].prefix.parent is not None:
            num_contiguous = 0
        del hit[num_contiguous:]
        return hit


def _extra_keys_of(request: KVCacheRequest):
    """``BlockHasher.extra_keys`` of the request's hasher if the request has extra keys (LoRA,
    multimodal, cache_salt), else ``None`` (every block's extra keys are ``b""``)."""
    hasher = request.block_hasher
    if hasher is not None and (
        request.lora_id is not None or request.mm_features or request.cache_salt is not None
    ):
        return hasher.extra_keys
    return None


def _matcher(request: KVCacheRequest, block_size: int):
    """``match(node, i)``: does ``node`` hold block ``i`` of ``request`` (tokens, extra keys)?"""
    tokens = request.all_token_ids
    extra_keys = _extra_keys_of(request)

    def match(node: PrefixNode, i: int) -> bool:
        start = i * block_size
        if node.token_ids != tokens[start : start + block_size]:
            return False
        return node.extra_keys == (b"" if extra_keys is None else extra_keys(request, i))

    return match


def _chain_matches(match, node: PrefixNode | None, index: int) -> bool:
    """Do ``node`` and its ancestors hold blocks ``index .. 0`` of the request, and end there?"""
    while index >= 0:
        if node is None or not match(node, index):
            return False
        node = node.parent
        index -= 1
    return node is None


def make_single_type_manager(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    """The manager class for the spec's attention type.

    Raises:
        ConfigError: an attention type without a manager.
    """
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        return SlidingWindowManager(kv_cache_spec, block_pool, kv_cache_group_id)
    if isinstance(kv_cache_spec, FullAttentionSpec):
        return FullAttentionManager(kv_cache_spec, block_pool, kv_cache_group_id)
    raise ConfigError(f"no KV-cache manager for spec type {type(kv_cache_spec).__name__}")
