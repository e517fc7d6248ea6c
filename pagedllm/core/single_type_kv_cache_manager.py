"""The blocks of one KV-cache group per request: full attention keeps them all, a sliding
window frees those that fell out of it, chunked local attention those of the chunks passed
(vLLM's ``FullAttentionManager`` / ``SlidingWindowManager`` / ``ChunkedLocalAttentionManager``),
a state group holds one state slot (``MambaManager``); plain Python, no torch.

With window W, block size 4 and W = 6, after 13 computed tokens the next query (position
13) sees keys 8 .. 13; blocks wholly before token 13 - W + 1 = 8 are replaced by the null
block (N) and go back to the pool, keeping their prefix-cache hash::

    tokens:      0..3 | 4..7 | 8..11 | 12..
    block_table: [ N  ,  N   ,  B7   ,  B2  ]
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from pagedllm.core.kv_cache_utils import BlockHash, hash_with_group_id
from pagedllm.core.request import Request


class SingleTypeKVCacheManager:
    """Per-request block lists of one group; the base class is full attention.

    Args:
        kv_cache_spec: the group's spec.
        block_pool: the pool shared by every group.
        group_id: the group's index (its prefix-cache keys: ``hash_with_group_id``).
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Request id -> blocks of it already registered in the prefix cache (or null).
        self.num_cached_blocks: dict[str, int] = {}

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of at most ``max_length`` tokens (a
        multiple of the block size) whose KV this group has: the blocks of the leading
        run of hits."""
        hits = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(hash_with_group_id(block_hash, self.group_id))
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the request's blocks that no query from ``num_computed_tokens`` on sees,
        replacing them by the null block: none for full attention."""

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock], num_computed_tokens: int,
    ) -> int:
        """Free blocks that giving the request slots for ``num_tokens`` tokens takes
        (``num_computed_tokens`` of them computed): the new blocks, and the prefix-cache
        hits ``new_computed_blocks`` that sit in the free queue."""
        del num_computed_tokens
        blocks = self.req_to_blocks.get(request_id)
        num_new = -(-num_tokens // self.block_size) - (len(blocks) if blocks else 0) - len(new_computed_blocks)
        if new_computed_blocks:
            num_new = max(num_new, 0) + self._num_evictable(new_computed_blocks)
        return max(num_new, 0)

    def _num_evictable(self, blocks: list[KVCacheBlock]) -> int:
        """Blocks among ``blocks`` that taking a reference removes from the free queue."""
        null = self.block_pool.null_block
        return sum(1 for b in blocks if b.ref_cnt == 0 and b is not null)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """Start a new request's list with its prefix-cache hits (referenced now; already cached)."""
        if not new_computed_blocks:
            return
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks.setdefault(request_id, []).extend(new_computed_blocks)
        self.num_cached_blocks[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> list[KVCacheBlock]:
        """New blocks so the request has slots for ``num_tokens`` tokens (``num_computed_tokens``
        of them computed)."""
        del num_computed_tokens
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        return self._extend(blocks, -(-num_tokens // self.block_size) - len(blocks))

    def _extend(self, blocks: list[KVCacheBlock], num_new: int) -> list[KVCacheBlock]:
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks full after ``num_tokens`` tokens in the prefix
        cache (``request.block_hashes`` must cover them)."""
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        blocks = self.req_to_blocks[request.request_id]
        null = self.block_pool.null_block
        for i in range(start, num_full):
            if blocks[i] is not null:
                self.block_pool.cache_full_block(blocks[i], hash_with_group_id(request.block_hashes[i], self.group_id))
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (so the chain's tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))


FullAttentionManager = SingleTypeKVCacheManager


class LocalAttentionManager(SingleTypeKVCacheManager):
    """A group whose layers see only recent keys (a sliding window, chunked local attention):
    the blocks wholly before the next query's first visible key (``num_skipped_tokens``) go
    back to the pool and the null block stands in for them. A subclass gives
    ``num_skipped_tokens`` and ``find_longest_cache_hit``."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        if block_pool.null_block is None:
            raise ValueError(f"A {kv_cache_spec.describe()} group needs a block pool with a null block.")
        super().__init__(kv_cache_spec, block_pool, group_id)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens no query from position ``num_computed_tokens`` on sees."""
        raise NotImplementedError

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """See the base class; the blocks wholly before the first key the query at
        ``num_computed_tokens`` sees go back to the pool (keeping their hash)."""
        num_skipped_blocks = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        blocks = self.req_to_blocks.get(request_id)
        if not num_skipped_blocks or not blocks:
            return
        null = self.block_pool.null_block
        removed = []
        for i in range(min(num_skipped_blocks, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break  # the ones before it were removed by an earlier call
            removed.append(blocks[i])
            blocks[i] = null  # type: ignore[assignment]
        self.block_pool.free_blocks(removed)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock], num_computed_tokens: int,
    ) -> int:
        """See the base class; blocks of skipped tokens are not needed."""
        blocks = self.req_to_blocks.get(request_id)
        num_held = (len(blocks) if blocks else 0) + len(new_computed_blocks)
        num_skipped_blocks = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        num_new = max(-(-num_tokens // self.block_size) - max(num_held, num_skipped_blocks), 0)
        return num_new + (self._num_evictable(new_computed_blocks) if new_computed_blocks else 0)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> list[KVCacheBlock]:
        """See the base class; the null block first for skipped tokens the request never
        had blocks for."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        num_skipped_blocks = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        if len(blocks) < num_skipped_blocks:
            blocks.extend([self.block_pool.null_block] * (num_skipped_blocks - len(blocks)))  # type: ignore[list-item]
        return self._extend(blocks, -(-num_tokens // self.block_size) - len(blocks))


class SlidingWindowManager(LocalAttentionManager):
    """A group of layers with a sliding window of W tokens (``SlidingWindowSpec``)."""

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(kv_cache_spec, block_pool, group_id)
        self.sliding_window = kv_cache_spec.sliding_window
        # A hit at position p needs the blocks of tokens p - W + 1 .. p - 1.
        self.num_hit_blocks_needed = cdiv(self.sliding_window - 1, self.block_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next query (at position ``num_computed_tokens``)."""
        return max(num_computed_tokens - self.sliding_window + 1, 0)

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The longest prefix of at most ``max_length`` tokens whose last W - 1 tokens'
        blocks are cached (vLLM's ``SlidingWindowManager.find_longest_cache_hit``): searched
        from the right; the blocks before the window are the null block. Without such a run,
        the leading run of hits (a prefix shorter than the window)."""
        num_blocks = max_length // self.block_size
        null = self.block_pool.null_block
        hits: list[KVCacheBlock] = [null] * num_blocks  # type: ignore[list-item]
        if self.num_hit_blocks_needed == 0:
            return hits  # W = 1: a query sees itself only
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(hash_with_group_id(block_hashes[i], self.group_id))
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= self.num_hit_blocks_needed:
                return hits[: i + run]
        return hits[:run]


class ChunkedLocalAttentionManager(LocalAttentionManager):
    """A group of chunked local attention of C tokens (``ChunkedLocalAttentionSpec``; vLLM's
    ``ChunkedLocalAttentionManager``): once the next query enters a new chunk, the blocks wholly
    before the chunk's first position go back to the pool. C = 8, block size 4, after 13
    computed tokens (the next query, position 13, sees 8 .. 13)::

        tokens:      0..3 | 4..7 | 8..11 | 12..
        block_table: [ N  ,  N   ,  B7   ,  B2  ]
    """

    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(kv_cache_spec, block_pool, group_id)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the chunk of the next query (at position ``num_computed_tokens``)."""
        return num_computed_tokens - num_computed_tokens % self.attention_chunk_size

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The longest prefix of at most ``max_length`` tokens whose blocks from its end's chunk
        on are cached: the blocks before that chunk are the null block (a prefix ending on a
        chunk boundary needs none). Where the run of hits stops inside an earlier chunk, the
        search starts again from there."""
        null = self.block_pool.null_block
        length = max_length // self.block_size * self.block_size
        while True:
            first = self.num_skipped_tokens(length) // self.block_size
            hits: list[KVCacheBlock] = [null] * first  # type: ignore[list-item]
            for block_hash in block_hashes[first : length // self.block_size]:
                block = self.block_pool.get_cached_block(hash_with_group_id(block_hash, self.group_id))
                if block is None:
                    break
                hits.append(block)
            hit_length = len(hits) * self.block_size
            if self.num_skipped_tokens(hit_length) // self.block_size >= first:
                return hits
            length = hit_length


class MambaManager(SingleTypeKVCacheManager):
    """A state group (``MambaSpec``; vLLM's ``MambaManager``): each request holds a *working*
    slot, a "block" of the group's own pool of ``num_slots`` (``block_id`` is the slot: the
    index into every state tensor's leading dimension), from its first allocation until it
    is freed (finished, aborted or preempted: a preempted request recomputes its state from
    its first token when it resumes, or from a saved state).

    With prefix caching (vLLM's ``mamba_cache_mode="align"``): the state after a request's
    last full block of known tokens (its *save point*, a multiple of ``block_size``; the
    scheduler ends a chunk there: ``save_point``) is copied into a *save* slot, registered
    under that block's hash once computed, and kept when the request ends (LRU, as blocks).
    A later request whose prefix ends at such a block hits it: the saved slot is copied into
    its working slot before its first step. A hit stops where no state is saved::

        tokens:   0 .. 7 | 8 .. 15 | 16 .. 19       (block size 8, 20 known tokens)
        states:                  ^ saved at 16 (the save point), under block 1's hash
        req_to_blocks[r] = [working, hit (if any), save (if any)]

    Args:
        kv_cache_spec: the group's spec.
        num_slots: slots in the group's pool (``kv_cache_sizing.num_state_slots``).
        group_id: the group's index among all groups.
        block_size: the attention blocks' tokens (the granularity of saved states).
        enable_caching: save states at save points and hit them.
    """

    def __init__(self, kv_cache_spec: MambaSpec, num_slots: int, group_id: int, block_size: int = 16,
                 enable_caching: bool = False) -> None:
        super().__init__(kv_cache_spec, BlockPool(num_slots, enable_caching), group_id)  # type: ignore[arg-type]
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Request id -> its hit slot, between the hit's saving and its first allocation.
        self._hits: dict[str, KVCacheBlock] = {}
        # Request id -> (save slot, save point): registered once the state is computed.
        self._pending_saves: dict[str, tuple[KVCacheBlock, int]] = {}

    def save_point(self, request: Request) -> int:
        """Tokens after which the request's state is saved: its known tokens' last block
        boundary before its last token (0: none, or caching off)."""
        if not self.enable_caching:
            return 0
        return (request.num_tokens - 1) // self.block_size * self.block_size

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The longest prefix of at most ``max_length`` tokens at whose end a state is
        saved, as that many blocks' worth of its slot (its length is the prefix's blocks);
        none without caching."""
        if not self.enable_caching:
            return []
        for num_blocks in range(max_length // self.block_size, 0, -1):
            block = self.block_pool.get_cached_block(hash_with_group_id(block_hashes[num_blocks - 1], self.group_id))
            if block is not None:
                return [block] * num_blocks
        return []

    def needs_slot(self, request_id: str) -> bool:
        """Whether the request has no working slot yet (its next allocation takes one)."""
        return request_id not in self.req_to_blocks

    def num_slots_needed(self, request: Request, new_computed_blocks: list[KVCacheBlock], num_tokens_after: int) -> int:
        """Free slots that allocating for the request up to ``num_tokens_after`` computed
        tokens takes: a working slot (the first time), its hit's slot if that is free, a save
        slot when the step ends at its save point."""
        num = int(self.needs_slot(request.request_id))
        if new_computed_blocks and new_computed_blocks[-1].ref_cnt == 0:
            num += 1
        return num + int(self._saves_at(request, num_tokens_after))

    def _saves_at(self, request: Request, num_tokens_after: int) -> bool:
        point = self.save_point(request)
        return (point > 0 and num_tokens_after == point and request.request_id not in self._pending_saves
                and len(self.req_to_blocks.get(request.request_id, ())) < 3)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """Take a reference on the hit's slot (its state is copied into the working slot)."""
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks[-1:])
            self._hits[request_id] = new_computed_blocks[-1]

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_computed_tokens: int) -> list[KVCacheBlock]:
        """The request's working slot and its hit's slot (if any), the first time; nothing
        afterwards (see ``allocate_save``)."""
        if not self.needs_slot(request_id):
            return []
        blocks = self.req_to_blocks[request_id] = self.block_pool.get_new_blocks(1)
        hit = self._hits.pop(request_id, None)
        if hit is not None:
            blocks.append(hit)
        return list(blocks)

    def allocate_save(self, request: Request, num_tokens_after: int) -> list[KVCacheBlock]:
        """A save slot, when the step ends at the request's save point (``num_tokens_after``
        computed tokens) and none is saved under that block yet; else nothing."""
        if not self._saves_at(request, num_tokens_after):
            return []
        block_hash = hash_with_group_id(request.block_hashes[num_tokens_after // self.block_size - 1], self.group_id)
        if self.block_pool.get_cached_block(block_hash) is not None:
            return []
        slot = self.block_pool.get_new_blocks(1)[0]
        self.req_to_blocks[request.request_id].append(slot)
        self._pending_saves[request.request_id] = (slot, num_tokens_after)
        return [slot]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's saved state once its step has run (``num_computed_tokens``
        past the save point: the scheduler counts a step's tokens when it schedules them and
        sees the request again only after the step)."""
        pending = self._pending_saves.get(request.request_id)
        if pending is None or request.num_computed_tokens < pending[1]:
            return
        slot, point = self._pending_saves.pop(request.request_id)
        self.block_pool.cache_full_block(
            slot, hash_with_group_id(request.block_hashes[point // self.block_size - 1], self.group_id))

    def free(self, request_id: str) -> None:
        """Release the request's slots (saved states keep their hash: LRU, as blocks)."""
        self._hits.pop(request_id, None)
        self._pending_saves.pop(request_id, None)
        super().free(request_id)
