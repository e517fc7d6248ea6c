"""Per-request block tables on top of the ``BlockPool``, one per KV-cache group (vLLM's
``KVCacheManager`` over its coordinator; no torch).

Token ``i`` of a request lives in ``block_table[i // block_size]`` at offset
``i % block_size`` of each group's table; a full-attention group holds
``ceil(num_tokens / block_size)`` blocks, never more (plus those of the lookahead slots it
asked for, see ``allocate_slots``); a sliding-window group only those its window still
sees, a chunked local attention group those of the next query's chunk, the others being the
null block (``pagedllm.core.single_type_kv_cache_manager``)::

    tokens:           0 .. 15 | 16 .. 31 | 32 .. 37
    full attention:   [  B4   ,    B9    ,    B1    ]   (B1 partly filled)
    sliding, W = 16:  [  N    ,    B3    ,    B8    ]
    chunked, C = 32:  [  N    ,    N     ,    B6    ]

A model with one kind of attention has one group: one table per request, as before groups.

State groups (Mamba-2, gated delta rule layers: ``MambaSpec``) come after the attention
groups in every per-group tuple; a request's "table" there is its working state slot (then
its hit's and save's slots, with prefix caching), taken at its first allocation from the
group's own pool (``MambaManager``) and returned with its blocks (finish, abort,
preemption). A request is admitted only when every group can give it what it needs: blocks
in the attention pool and slots in each state group. With prefix caching a hit must be
valid for the state groups too: it ends where a state is saved.

With a second KV tier (``offloading``, ``pagedllm.core.kv_offload``; a model of one
full-attention group) a cached block evicted from the pool is stored there, and a lookup
continues there past the pool's hits (``get_num_offloaded_hit_tokens``): those blocks are
allocated with ``delay_cache_blocks`` and loaded (``load_offloaded``) before the request runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroups,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from pagedllm.core.kv_offload import KVTransfer, OffloadingManager
from pagedllm.core.kv_cache_utils import (
    extend_block_hashes,
    first_block_extra_keys,
    get_hash_fn,
    root_block_hash,
)
from pagedllm.core.request import Request
from pagedllm.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)


#: The manager of each local-attention spec (any other spec: ``FullAttentionManager``).
_ATTENTION_MANAGERS: dict[type, type[SingleTypeKVCacheManager]] = {
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
}


@dataclass
class KVCacheBlocks:
    """Blocks of one request, per group (vLLM's ``KVCacheBlocks``): ``blocks[g]`` for group g
    (attention groups, then state groups: their slot, as a one-block list)."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The block ids, per group."""
        return tuple([[b.block_id for b in group] for group in self.blocks])


def single_group(block_size: int) -> KVCacheGroups:
    """The groups of a model whose layers all attend fully: one group (layers unnamed)."""
    return KVCacheGroups((KVCacheGroupSpec((), FullAttentionSpec(block_size, 0, 0, 0)),), 1)


class KVCacheManager:
    """Allocates, shares (prefix caching) and frees the blocks of each request, in every group.

    Args:
        num_blocks: number of physical blocks (block 0 is the null block when a group has a
            sliding window or chunked local attention).
        block_size: tokens per block.
        enable_caching: automatic prefix caching on/off.
        hash_algo: ``sha256``, ``sha256_cbor`` or ``xxhash``.
        hash_seed: seed of the root hash (see ``root_block_hash``).
        kv_cache_groups: the model's groups (``pagedllm.core.kv_cache_interface``); None: one
            full-attention group.
        num_state_slots: state slots in each state group's pool (``max_num_seqs``); unused
            without state groups.
        offloading: the second KV tier's index, or None (no second tier).

    Raises:
        ValueError: groups of another block size; state groups with fewer than one slot; a
            second tier without prefix caching, or for a model other than one full-attention
            group.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: Optional[str] = None,
        kv_cache_groups: Optional[KVCacheGroups] = None,
        num_state_slots: int = 0,
        offloading: Optional[OffloadingManager] = None,
    ) -> None:
        groups = kv_cache_groups or single_group(block_size)
        if groups.groups and groups.block_size != block_size:
            raise ValueError(f"KV-cache groups of block size {groups.block_size}, not {block_size}.")
        if groups.state_groups and num_state_slots < 1:
            raise ValueError(f"A model with state layers needs at least one state slot, got {num_state_slots}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_cache_groups = groups
        # NOTE: a model of state layers only, or an encoder, has no attention blocks; its pool holds
        # one, never used.
        self.block_pool = BlockPool(num_blocks if groups.groups else max(num_blocks, 1), enable_caching,
                                    use_null_block=groups.has_local_attention)
        #: The attention groups' managers (group g is ``managers[g]``).
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            _ATTENTION_MANAGERS.get(type(g.kv_cache_spec), FullAttentionManager)(  # type: ignore[arg-type]
                g.kv_cache_spec, self.block_pool, i)
            for i, g in enumerate(groups.groups)
        )
        #: The state groups' managers (state group s is group ``len(managers) + s``).
        self.state_managers: tuple[MambaManager, ...] = tuple(
            MambaManager(g.kv_cache_spec, num_state_slots, len(groups.groups) + s,  # type: ignore[arg-type]
                         block_size, enable_caching)
            for s, g in enumerate(groups.state_groups)
        )
        self.hash_fn = get_hash_fn(hash_algo)
        self.root_hash = root_block_hash(self.hash_fn, hash_algo, hash_seed)
        self.empty_blocks = KVCacheBlocks(tuple([] for _ in range(groups.num_groups)))
        # Prefix-cache statistics in tokens (read and reset by the scheduler each step).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # The same for the second tier (vLLM's external prefix cache), in tokens.
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.offloading = offloading
        if offloading is not None:
            self._check_offloading(groups)
            self.block_pool.on_evict = lambda block, key: offloading.store(block.block_id, key)

    def _check_offloading(self, groups: KVCacheGroups) -> None:
        if not self.enable_caching:
            raise ValueError("KV offloading (--kv-offloading-size) keeps blocks evicted from the prefix cache: it "
                             "needs prefix caching (--enable-prefix-caching).")
        if groups.state_groups or len(groups.groups) != 1 or not isinstance(groups.groups[0].kv_cache_spec,
                                                                             FullAttentionSpec):
            raise ValueError("KV offloading (--kv-offloading-size) supports models whose layers all attend fully "
                             "(one KV-cache group); sliding windows and state layers are not supported.")

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            self.hash_fn,
            self.root_hash,
            first_block_extra_keys(request.cache_salt, request.lora_key),
            num_full_blocks,
            [(f.mm_position.offset, f.mm_position.end, f.identifier) for f in request.mm_features],
        )

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request's tokens valid for every group, as
        (blocks per group, number of tokens): each group's longest hit within the length
        the others allow, until all agree (vLLM's hybrid coordinator). A sliding-window
        group needs only the blocks inside its window at the hit's end.

        The hit never covers the whole sequence: the last token is always computed so its
        logits exist. Requests asking for prompt logprobs skip the cache (those need the
        logits of every prompt position).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.empty_blocks, 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_hit_blocks)
        hit_length = max_hit_blocks * self.block_size
        managers = self.all_managers
        hits: list[list[KVCacheBlock]] = [[] for _ in managers]
        agreed = False
        while not agreed:
            agreed = True
            for g, manager in enumerate(managers):
                hits[g] = manager.find_longest_cache_hit(request.block_hashes, hit_length)
                if len(hits[g]) * self.block_size < hit_length:
                    hit_length = len(hits[g]) * self.block_size
                    agreed = len(managers) == 1
        num_hit_blocks = hit_length // self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += hit_length
        return KVCacheBlocks(tuple(h[:num_hit_blocks] for h in hits)), hit_length

    def get_num_offloaded_hit_tokens(self, request: Request, num_hit_tokens: int) -> int:
        """Tokens past the pool's ``num_hit_tokens`` hit that the second tier holds (whole
        blocks, the last token never; pinned there for this step); 0 without a second tier."""
        if self.offloading is None or not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        first = num_hit_tokens // self.block_size
        num_hits = self.offloading.lookup(request.block_hashes[first:max_hit_blocks])
        self.offloading.pin(request.block_hashes[first : first + num_hits])
        self.external_prefix_cache_queries += request.num_tokens
        self.external_prefix_cache_hits += num_hits * self.block_size
        return num_hits * self.block_size

    def load_offloaded(self, request: Request, num_hit_tokens: int, num_offloaded_tokens: int) -> None:
        """List the loads of the request's ``num_offloaded_tokens`` tokens after
        ``num_hit_tokens`` from the second tier into its blocks there (allocated by
        ``allocate_slots`` with ``delay_cache_blocks``)."""
        assert self.offloading is not None
        first, end = num_hit_tokens // self.block_size, (num_hit_tokens + num_offloaded_tokens) // self.block_size
        blocks = self.managers[0].req_to_blocks[request.request_id][first:end]
        self.offloading.load(request.request_id, request.block_hashes[first:end], [b.block_id for b in blocks])

    def take_kv_transfers(self) -> list[KVTransfer]:
        """The second tier's transfers since the last call (empty without one)."""
        return self.offloading.take_transfers() if self.offloading is not None else []

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[KVCacheBlocks] = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> Optional[KVCacheBlocks]:
        """Make room for ``num_new_tokens`` more tokens of ``request``, plus
        ``num_lookahead_tokens`` slots after them (for speculative tokens), in every group.

        ``new_computed_blocks`` are prefix-cache hits being added at admission (their
        tokens count as computed). First the blocks that fell out of a sliding window go
        back to the pool. Lookahead slots get blocks but are never cached: only full blocks
        of the request's own tokens are hashed. With block_size 4, 4 computed tokens (c), 3
        new (n) and 4 lookahead slots (L)::

            | c c c c | n n n L | L L L . |
              cached    not cached (holds a lookahead slot), not cached

        A request without a state slot takes one in each state group (at admission).
        ``delay_cache_blocks`` (vLLM's): register none of the new full blocks in the prefix
        cache yet (their KV is still being loaded; the next allocation registers them).

        Returns the newly allocated blocks per group (possibly none; a state group's slot
        the first time), or None, allocating nothing, when too few blocks are free for all
        groups together or a state group has no free slot.
        """
        new_computed = (new_computed_blocks or self.empty_blocks).blocks
        req_id = request.request_id
        num_hit_blocks = len(new_computed[0]) if new_computed else 0
        num_computed_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_tokens_after = num_computed_tokens + num_new_tokens
        state_hits = new_computed[len(self.managers):]
        if self.state_managers and not self._state_slots_free(request, state_hits, num_computed_tokens,
                                                              num_tokens_after):
            return None
        num_slots = num_tokens_after + num_lookahead_tokens
        managers = self.managers
        if self.block_pool.null_block is not None:  # some group has a window
            for manager in managers:
                manager.remove_skipped_blocks(req_id, request.num_computed_tokens)
        num_needed = 0
        for manager, computed in zip(managers, new_computed):
            num_needed += manager.get_num_blocks_to_allocate(req_id, num_slots, computed, num_computed_tokens)
        if num_needed > self.block_pool.free_block_queue.num_free_blocks:
            return None
        # NOTE: every group's hits are referenced before any group takes new blocks: a hit of
        # one group may sit in the free queue, where another group's new blocks come from.
        for manager, computed in zip(managers, new_computed):
            if computed:
                manager.save_new_computed_blocks(req_id, computed)
        new_blocks = [manager.allocate_new_blocks(req_id, num_slots, num_computed_tokens) for manager in managers]
        if self.enable_caching and not delay_cache_blocks:
            num_cached_tokens = min(num_tokens_after, request.num_tokens)
            if num_cached_tokens // self.block_size > len(request.block_hashes):
                self._update_block_hashes(request, num_cached_tokens // self.block_size)
            for manager in self.managers:
                manager.cache_blocks(request, num_cached_tokens)
        for state, hits in zip(self.state_managers, state_hits):
            state.save_new_computed_blocks(req_id, hits)
            new_blocks.append(state.allocate_new_blocks(req_id, num_slots, num_computed_tokens)
                              + state.allocate_save(request, num_tokens_after))
        return KVCacheBlocks(tuple(new_blocks))

    def _state_slots_free(self, request: Request, state_hits: tuple[list[KVCacheBlock], ...],
                          num_computed_tokens: int, num_tokens_after: int) -> bool:
        """Whether every state group has the slots the allocation takes, after registering
        the state the request's previous step saved (``MambaManager.cache_blocks``)."""
        for state, hits in zip(self.state_managers, state_hits):
            state.cache_blocks(request, num_computed_tokens)
            if state.num_slots_needed(request, hits, num_tokens_after) > state.block_pool.get_num_free_blocks():
                return False
        return True

    def align_to_save_point(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """``num_new_tokens`` for a step of ``request`` from ``num_computed_tokens``, cut to end
        at its state groups' save point when it would pass it (prefix caching with state
        layers: the state there is saved for later hits; ``MambaManager.save_point``)."""
        if not self.enable_caching or not self.state_managers:
            return num_new_tokens
        point = self.state_managers[0].save_point(request)
        if num_computed_tokens < point < num_computed_tokens + num_new_tokens:
            return point - num_computed_tokens
        return num_new_tokens

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group, tail first (so the chain's tail is
        evicted first), and its state slots."""
        for state in self.state_managers:
            state.cache_blocks(request, request.num_computed_tokens)
        for manager in self.all_managers:
            manager.free(request.request_id)

    @property
    def all_managers(self) -> tuple[SingleTypeKVCacheManager, ...]:
        """Every group's manager, in group order (attention groups, then state groups)."""
        return self.managers + self.state_managers

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks, per group (the null block where a window let go)."""
        return KVCacheBlocks(tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.all_managers))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table, per group (a state group's: its slot)."""
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.all_managers)

    def has_requests(self) -> bool:
        """Whether any request holds a block table or a state slot (in any group)."""
        return any(m.req_to_blocks for m in self.all_managers)

    def num_requests_holding_blocks(self) -> int:
        """Requests that hold at least one block (the null block aside) in some group."""
        null = self.block_pool.null_block
        return len({req_id for m in self.all_managers for req_id, blocks in m.req_to_blocks.items()
                    if any(b is not null for b in blocks)})

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks (the second tier's too); False while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.offloading is not None:
            self.offloading.clear()
        return True

    @property
    def usage(self) -> float:
        """Fraction of the attention blocks in use (of the state slots, in a model of state
        layers only)."""
        if not self.managers and self.state_managers:
            return self.state_managers[0].block_pool.get_usage()
        return self.block_pool.get_usage()
