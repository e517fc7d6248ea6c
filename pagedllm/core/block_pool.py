"""Physical KV-cache blocks, the LRU free queue and the prefix-cache map (no torch).

Free queue layout (a doubly linked list threaded through the blocks themselves)::

    head <-> B7 <-> B2 <-> B9 <-> tail
    (evict first)         (freed last)

``popleft`` takes the least recently freed block; freeing appends at the tail; a
prefix-cache hit on a free block removes it from the middle in O(1).

With sliding-window layers the pool reserves block 0 as the *null block* (vLLM's
``null_block``): it stands in a block table for blocks that fell out of a window, is never
handed out, never freed and never counted (its ref count stays 0).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from pagedllm.core.kv_cache_utils import BlockHash


class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's KV cache.

    Attributes:
        block_id: index into the KV-cache tensors' block dimension.
        ref_cnt: number of requests using the block; 0 means it is in the free queue.
        block_hash: set once the block is full and registered in the prefix cache; kept
            after the block is freed (so it can still be hit) until it is evicted.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked LRU queue of free blocks with O(1) removal from the middle."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block.

        Raises:
            ValueError: if the queue is empty.
        """
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("No free KV-cache blocks left.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` (which must be in the queue)."""
        assert block.prev_free is not None and block.next_free is not None
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (most recently freed; evicted last)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """All KV-cache blocks: the free queue and the ``block_hash -> block`` prefix-cache map.

    Invariant (checked by ``check_integrity``): every block but the null block is either in
    use (``ref_cnt > 0``) or in the free queue; a block in the map has that hash. The map's
    keys are ``hash_with_group_id``'s: each KV-cache group caches its own blocks.

    Args:
        num_blocks: physical blocks (block ids 0 .. num_blocks - 1).
        enable_caching: keep freed blocks' hashes (prefix caching).
        use_null_block: reserve block 0 as the null block (``null_block``; None without).

    ``on_evict`` (None: nothing) is called with each cached block, and its key, when its
    hash is evicted for reuse (the second KV tier stores it: ``pagedllm.core.kv_offload``).
    """

    def __init__(self, num_blocks: int, enable_caching: bool, use_null_block: bool = False) -> None:
        if num_blocks < 1 + use_null_block:
            raise ValueError(f"num_blocks must be at least {1 + use_null_block}, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: Optional[KVCacheBlock] = self.blocks[0] if use_null_block else None
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[int(use_null_block):])
        #: Blocks requests can hold (all but the null block).
        self.num_usable_blocks = num_blocks - int(use_null_block)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.on_evict: Optional[Callable[[KVCacheBlock, BlockHash], None]] = None

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks in use by requests, 0.0 - 1.0."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue (evicting their hashes).

        Raises:
            ValueError: if fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"Cannot get {num_blocks} free blocks; only {self.get_num_free_blocks()} are free."
            )
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block, block.block_hash)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, removing free ones from the free queue
        (the null block is skipped)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under ``block_hash`` (the first block with a hash wins)."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free queue's
        tail in the given order (so pass a request's blocks in reverse: its chain's tail
        is then evicted first). The null block is skipped."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Returns False (and changes nothing) while any block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def check_integrity(self) -> None:
        """Assert the accounting invariant: free + in use == total, and the map is consistent.

        Raises:
            AssertionError: with the counts, if the invariant is broken.
        """
        free = list(self.free_block_queue)
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt == 0 for b in free), "a block in the free queue has references"
        assert len(free) == self.free_block_queue.num_free_blocks
        assert len(free) + len(in_use) == self.num_usable_blocks, (
            f"free ({len(free)}) + in use ({len(in_use)}) != total ({self.num_usable_blocks})"
        )
        if self.null_block is not None:
            assert self.null_block.ref_cnt == 0 and self.null_block.block_hash is None, "the null block was used"
            assert self.null_block not in free, "the null block is in the free queue"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, "prefix-cache map points at a re-used block"
