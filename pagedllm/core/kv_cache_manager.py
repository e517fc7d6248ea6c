"""Per-request block tables on top of the ``BlockPool`` (no torch).

Token ``i`` of a request lives in ``block_table[i // block_size]`` at offset
``i % block_size``; a request holds ``ceil(num_tokens / block_size)`` blocks, never more
(plus those of the lookahead slots it asked for, see ``allocate_slots``)::

    tokens:      0 .. 15 | 16 .. 31 | 32 .. 37
    block_table: [  B4   ,    B9    ,    B1    ]   (B1 partly filled)
"""

from __future__ import annotations

from typing import Optional

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_utils import (
    extend_block_hashes,
    first_block_extra_keys,
    get_hash_fn,
    root_block_hash,
)
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


class KVCacheManager:
    """Allocates, shares (prefix caching) and frees the blocks of each request.

    Args:
        num_blocks: number of physical blocks.
        block_size: tokens per block.
        enable_caching: automatic prefix caching on/off.
        hash_algo: ``sha256``, ``sha256_cbor`` or ``xxhash``.
        hash_seed: seed of the root hash (see ``root_block_hash``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: Optional[str] = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.hash_fn = get_hash_fn(hash_algo)
        self.root_hash = root_block_hash(self.hash_fn, hash_algo, hash_seed)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics in tokens (read and reset by the scheduler each step).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            self.hash_fn,
            self.root_hash,
            first_block_extra_keys(request.cache_salt, request.lora_key),
            num_full_blocks,
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens, as (blocks, number of tokens).

        The hit never covers the whole sequence: the last token is always computed so its
        logits exist. Requests asking for prompt logprobs skip the cache (those need the
        logits of every prompt position).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_hit_blocks)
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
        num_lookahead_tokens: int = 0,
    ) -> Optional[list[KVCacheBlock]]:
        """Make room for ``num_new_tokens`` more tokens of ``request``, plus
        ``num_lookahead_tokens`` slots after them (for speculative tokens).

        ``new_computed_blocks`` are prefix-cache hits being added at admission (their
        tokens count as computed). Lookahead slots get blocks but are never cached: only
        full blocks of the request's own tokens are hashed. With block_size 4, 4 computed
        tokens (c), 3 new (n) and 4 lookahead slots (L)::

            | c c c c | n n n L | L L L . |
              cached    not cached (holds a lookahead slot), not cached

        Returns the newly allocated blocks (possibly empty), or None, changing nothing,
        when too few blocks are free.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_tokens_after = num_computed_tokens + num_new_tokens
        num_required = cdiv(num_tokens_after + num_lookahead_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Hits that sit in the free queue stop being available once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(num_tokens_after, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full)
        for i in range(start, num_full):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so the chain's tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()
