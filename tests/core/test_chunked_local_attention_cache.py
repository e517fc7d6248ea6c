"""KV-cache groups of chunked local attention (Llama 4's ``attention_chunk_size``) beside full
attention: the blocks of passed chunks go back to the pool and are reused, a request holds at
most the blocks of its current chunk (and the step's), and a prefix hit needs only the blocks
of the chunk its end falls in."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    cdiv,
    group_layers,
    layer_kv_cache_specs,
)
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager
from tests.core.test_kv_cache_manager import make_request

BS, C = 8, 16
FULL = FullAttentionSpec(BS, 2, 16, 4)
CHUNKED = ChunkedLocalAttentionSpec(BS, 2, 16, 4, C)


def llama4_groups(chunk: int = C):
    """Three chunked layers and one full (Llama 4's pattern)."""
    return group_layers(layer_kv_cache_specs([None] * 4, BS, 2, 16, 4, attention_chunk_sizes=[chunk] * 3 + [None]))


def test_chunked_layers_form_their_own_groups_after_full_attention():
    groups = llama4_groups()
    assert groups.group_size == 1 and groups.has_local_attention and not groups.has_sliding_window
    assert [(g.layer_indices, g.kv_cache_spec) for g in groups.groups] == [
        ((3,), FULL), ((0,), CHUNKED), ((1,), CHUNKED), ((2,), CHUNKED)]
    manager = KVCacheManager(16, BS, kv_cache_groups=groups)
    assert [type(m) for m in manager.managers[1:]] == [ChunkedLocalAttentionManager] * 3
    assert manager.block_pool.null_block is not None


def test_chunked_group_frees_blocks_of_passed_chunks_and_they_are_reused():
    manager = KVCacheManager(64, BS, kv_cache_groups=llama4_groups())
    full, chunked = manager.managers[0], manager.managers[1]
    null = manager.block_pool.null_block
    a = make_request("a", list(range(40)))
    assert manager.allocate_slots(a, 40) is not None
    a.num_computed_tokens = 40
    freed: set[int] = set()
    bound = cdiv(C, BS) + 1
    for step in range(40):
        before = {b.block_id for b in chunked.req_to_blocks["a"]}
        a.append_output_token_id(1000 + step)
        assert manager.allocate_slots(a, 1) is not None
        # The query at num_computed_tokens sees its chunk's keys only: the blocks before the
        # chunk's first position are the null block, the chunk's own are real.
        first_seen = (a.num_computed_tokens - a.num_computed_tokens % C) // BS
        a.num_computed_tokens += 1
        blocks = chunked.req_to_blocks["a"]
        held = [b for b in blocks if b is not null]
        assert len(held) <= bound, f"step {step}: {len(held)} blocks held in a chunked group"
        assert all(b is null for b in blocks[:first_seen]) and all(b is not null for b in blocks[first_seen:])
        assert len(full.req_to_blocks["a"]) == cdiv(a.num_computed_tokens, BS)
        freed |= before - {b.block_id for b in blocks}
    # Positions 40 .. 79 crossed the chunks at 48, 64: each crossing let go of the chunk before.
    assert len(freed) >= 2 * cdiv(C, BS) and null.block_id not in freed
    pool = manager.block_pool
    assert all(pool.blocks[i].ref_cnt == 0 and pool.blocks[i].block_hash is not None for i in freed)
    pool.check_integrity()
    # Another request takes blocks a chunk let go (the free queue's never-used blocks first:
    # take them all so freed ones must come back).
    b = make_request("b", list(range(500, 500 + pool.get_num_free_blocks() // 4 * BS)))
    blocks = manager.allocate_slots(b, b.num_tokens)
    assert blocks is not None
    assert freed & {blk.block_id for group in blocks.blocks for blk in group}
    manager.free(a)
    manager.free(b)
    pool.check_integrity()
    assert pool.get_num_free_blocks() == pool.num_usable_blocks == 63


def test_prefix_hit_in_a_chunked_group_needs_only_the_current_chunk():
    manager = KVCacheManager(64, BS, kv_cache_groups=llama4_groups())
    null = manager.block_pool.null_block
    prompt = list(range(100, 160))  # 60 tokens: 7 full blocks
    a = make_request("a", prompt)
    manager.allocate_slots(a, 60)
    a.num_computed_tokens = 60
    manager.free(a)
    b = make_request("b", prompt + [1, 2, 3])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 56
    # Full attention: all 7 blocks; a chunked group: the chunk of position 56 (48 ..) only.
    assert len(hits.blocks[0]) == 7 and all(b is not null for b in hits.blocks[0])
    for group in hits.blocks[1:]:
        assert [blk is null for blk in group] == [True] * 6 + [False]
    assert manager.allocate_slots(b, b.num_tokens - 56, hits) is not None
    b.num_computed_tokens = b.num_tokens
    manager.free(b)
    manager.block_pool.check_integrity()
    # The current chunk's block evicted from one chunked group: the hit ends at that chunk's
    # start (48), where the chunked groups need no block at all.
    manager.block_pool._evict(hits.blocks[2][6])
    c = make_request("c", prompt + [4])
    hits, num_hit = manager.get_computed_blocks(c)
    assert num_hit == 48
    assert len(hits.blocks[0]) == 6 and all(len(g) == 6 and all(b is null for b in g) for g in hits.blocks[1:])


def test_chunked_hit_search_restarts_when_the_run_ends_in_an_earlier_chunk():
    """C = 12 with blocks of 8: a chunk starts inside a block; a run of hits that stops before
    the last chunk's start must then hold the blocks of its own, earlier chunk."""
    manager = KVCacheManager(64, BS, kv_cache_groups=llama4_groups(chunk=12))
    chunked = manager.managers[1]
    prompt = list(range(300, 340))  # 40 tokens: 5 full blocks
    a = make_request("a", prompt)
    manager.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    manager.free(a)
    request = make_request("d", prompt + [9])
    manager._update_block_hashes(request, 5)
    null = manager.block_pool.null_block
    # A 40-token hit: its chunk starts at 36, inside block 4: only block 4 is needed.
    hits = chunked.find_longest_cache_hit(request.block_hashes, 40)
    assert [b is null for b in hits] == [True] * 4 + [False]
    # Block 4 evicted: the run stops at 32 tokens, whose chunk starts at 24 (block 3): the
    # search starts again there and holds block 3 (the keys 24 .. 31 a query at 32 sees).
    manager.block_pool._evict(hits[4])
    hits = chunked.find_longest_cache_hit(request.block_hashes, 40)
    assert [b is null for b in hits] == [True] * 3 + [False]

@pytest.mark.parametrize("chunk,step,expected", [(16, 1, 3), (16, 16, 5), (32, 16, 7), (1024, 16, 16)])
def test_chunked_spec_bounds(chunk, step, expected):
    """Blocks per request: the chunk's earlier keys and a step's tokens (one block more across a
    boundary), never more than the whole context (128 tokens: 16 blocks)."""
    assert ChunkedLocalAttentionSpec(BS, 2, 16, 4, chunk).max_num_blocks(128, step) == expected


def test_chunked_spec_refuses_a_chunk_below_one_token():
    with pytest.raises(ValueError, match="attention_chunk_size must be a positive"):
        ChunkedLocalAttentionSpec(BS, 2, 16, 4, 0)
