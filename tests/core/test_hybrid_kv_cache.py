"""KV-cache groups (full attention beside sliding windows): grouping of layers, the blocks a
sliding-window group holds and frees, their reuse, and prefix hits valid for every group."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_interface import (
    FullAttentionSpec,
    SlidingWindowSpec,
    cdiv,
    group_layers,
    layer_kv_cache_specs,
)
from pagedllm.core.kv_cache_manager import KVCacheManager
from tests.core.test_kv_cache_manager import make_request

BS, W = 8, 16
FULL = FullAttentionSpec(BS, 2, 16, 4)
SW = SlidingWindowSpec(BS, 2, 16, 4, W)


def specs(kinds: str) -> list:
    """'s' sliding, 'f' full, one letter per layer."""
    return layer_kv_cache_specs([W if k == "s" else None for k in kinds], BS, 2, 16, 4)


def test_layers_are_grouped_by_spec_in_groups_of_equal_size():
    groups = group_layers(specs("sfss"))
    assert groups.group_size == 1
    assert [(g.layer_indices, g.kv_cache_spec) for g in groups.groups] == [((1,), FULL), ((0,), SW), ((2,), SW), ((3,), SW)]
    # Gemma 3's 5 sliding : 1 full, twice: groups of 2 layers, the sliding ones dealt round-robin.
    gemma = group_layers(specs("sssssf" * 2))
    assert gemma.group_size == 2 and [g.layer_indices for g in gemma.groups] == [
        (5, 11), (0, 6), (1, 7), (2, 8), (3, 9), (4, 10)]
    # 7 sliding : 3 full: groups of 3, the last sliding group padded (2 layers).
    padded = group_layers(specs("sssssss" + "fff"))
    assert [g.layer_indices for g in padded.groups] == [(7, 8, 9), (0, 3, 6), (1, 4), (2, 5)]
    assert padded.block_bytes == 3 * FULL.page_size_bytes
    # Kinds within 1.25 x of each other: one group each, the smaller padded (vLLM's rule).
    close = group_layers(specs("s" * 12 + "f" * 13))
    assert close.group_size == 13 and len(close.groups) == 2
    # One kind: one group, today's layout.
    assert len(group_layers(specs("ffff")).groups) == 1


def test_gemma_groups_hold_every_layer_once():
    groups = group_layers(specs("sssssf" * 2))
    layers = sorted(i for g in groups.groups for i in g.layer_indices)
    assert layers == list(range(12))


def test_sliding_group_frees_blocks_outside_the_window_and_they_are_reused():
    manager = KVCacheManager(32, BS, kv_cache_groups=group_layers(specs("sf")))
    full, sliding = manager.managers
    a = make_request("a", list(range(40)))
    assert manager.allocate_slots(a, 40) is not None
    a.num_computed_tokens = 40
    freed: set[int] = set()
    bound = cdiv(W, BS) + 1
    for step in range(30):
        before = {b.block_id for b in sliding.req_to_blocks["a"]}
        a.append_output_token_id(1000 + step)
        assert manager.allocate_slots(a, 1) is not None
        # Every block before the window of this step's query (at num_computed_tokens) is
        # the null block; the window's own are real.
        first_seen = max(a.num_computed_tokens - W + 1, 0) // BS
        a.num_computed_tokens += 1
        held = [b for b in sliding.req_to_blocks["a"] if b is not manager.block_pool.null_block]
        assert len(held) <= bound, f"step {step}: {len(held)} blocks held in the window's group"
        assert all(b.block_id == 0 for b in sliding.req_to_blocks["a"][:first_seen])
        assert all(b.block_id != 0 for b in sliding.req_to_blocks["a"][first_seen:])
        assert len(full.req_to_blocks["a"]) == cdiv(a.num_computed_tokens, BS)
        freed |= before - {b.block_id for b in sliding.req_to_blocks["a"]}
    assert freed and 0 not in freed
    # Back in the pool with their hashes: still prefix-cache hits.
    pool = manager.block_pool
    assert all(pool.blocks[i].ref_cnt == 0 and pool.blocks[i].block_hash is not None for i in freed)
    assert all(pool.get_cached_block(pool.blocks[i].block_hash) is pool.blocks[i] for i in freed)
    pool.check_integrity()
    # Another request takes the blocks the window let go (the LRU head holds never-used
    # blocks first: fill the pool so freed ones must come back).
    num_free = manager.block_pool.get_num_free_blocks()
    b = make_request("b", list(range(500, 500 + (num_free // 2) * BS)))
    blocks = manager.allocate_slots(b, b.num_tokens)
    assert blocks is not None
    assert freed & {blk.block_id for group in blocks.blocks for blk in group}
    manager.free(a)
    manager.free(b)
    manager.block_pool.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_usable_blocks == 31


def test_prefix_hit_in_a_sliding_group_needs_only_the_window():
    manager = KVCacheManager(64, BS, kv_cache_groups=group_layers(specs("sf")))
    full, sliding = manager.managers
    prompt = list(range(100, 160))  # 60 tokens: 7 full blocks
    a = make_request("a", prompt)
    hits, num_hit = manager.get_computed_blocks(a)
    assert num_hit == 0
    manager.allocate_slots(a, 60, hits)
    a.num_computed_tokens = 60
    manager.free(a)
    b = make_request("b", prompt + [1, 2, 3])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 56
    # Full attention: all 7 blocks; the window (W - 1 = 15 tokens: 2 blocks) before token 56.
    assert len(hits.blocks[0]) == len(hits.blocks[1]) == 7
    assert [blk.block_id == 0 for blk in hits.blocks[1]] == [True] * 5 + [False] * 2
    assert manager.allocate_slots(b, b.num_tokens - 56, hits) is not None
    assert [blk.ref_cnt for blk in sliding.req_to_blocks["b"][5:7]] == [1, 1]
    b.num_computed_tokens = b.num_tokens
    manager.free(b)
    manager.block_pool.check_integrity()
    # The window's blocks evicted from the sliding group: a hit ends earlier, where both
    # groups still have what its window needs.
    sliding_block = hits.blocks[1][6]
    manager.block_pool._evict(sliding_block)
    c = make_request("c", prompt + [4])
    hits, num_hit = manager.get_computed_blocks(c)
    assert num_hit == 48 and len(hits.blocks[0]) == 6
    assert [blk.block_id == 0 for blk in hits.blocks[1]] == [True] * 4 + [False] * 2
    assert manager.allocate_slots(c, c.num_tokens - 48, hits) is not None
    manager.free(c)
    manager.block_pool.check_integrity()


def test_hits_of_every_group_are_referenced_before_any_group_takes_new_blocks():
    # A full group and two sliding ones, 15 usable blocks: a's 40 tokens take 5 in each;
    # freed, they sit in the free queue (full's, then each sliding group's, tails first).
    # b's hit (40 tokens) takes all 5 full blocks and the last 2 of each sliding group, and
    # each group 2 new blocks: the free queue's head after the full hits is the first
    # sliding group's hits, which no group may take as a new block.
    manager = KVCacheManager(16, BS, kv_cache_groups=group_layers(specs("ssf")))
    a = make_request("a", list(range(100, 140)))
    assert manager.allocate_slots(a, 40) is not None
    a.num_computed_tokens = 40
    manager.free(a)
    b = make_request("b", list(range(100, 140)) + list(range(9)))
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 40
    assert manager.allocate_slots(b, b.num_tokens - 40, hits) is not None
    null = manager.block_pool.null_block
    held = [blk.block_id for group in manager.get_blocks("b").blocks for blk in group if blk is not null]
    assert len(held) == len(set(held)) == 5 + 2 + 2 + 3 * 2, "a block sits in two groups' tables"
    assert all(manager.block_pool.blocks[i].ref_cnt == 1 for i in held)
    b.num_computed_tokens = b.num_tokens
    manager.free(b)
    manager.block_pool.check_integrity()


def test_admission_counts_every_group():
    # 3 sliding groups and a full one, 12 usable blocks: a 40-token prompt needs 5 blocks in
    # each group (the chunk is computed at once), 20 in all: refused; 16 tokens fit (2 x 4).
    manager = KVCacheManager(13, BS, kv_cache_groups=group_layers(specs("sfss")))
    assert manager.allocate_slots(make_request("big", list(range(40))), 40) is None
    assert not manager.has_requests()
    small = make_request("small", list(range(16)))
    blocks = manager.allocate_slots(small, 16)
    assert [len(g) for g in blocks.blocks] == [2, 2, 2, 2]
    assert manager.block_pool.get_num_free_blocks() == 4
    manager.free(small)
    manager.block_pool.check_integrity()


def test_sliding_window_spec_bounds():
    assert SW.max_num_blocks(4096, 8) == cdiv(W - 1 + 8, BS) + 1
    assert SW.max_num_blocks(16, 2048) == 2  # never more than the whole context
    assert FULL.max_num_blocks(4096, 8) == 512
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(BS, 2, 16, 4, 0)


def test_scheduler_sends_a_table_per_group_with_null_blocks_after_a_hit():
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.messages.engine_core import EngineCoreRequest
    from pagedllm.messages.runner_output import ModelRunnerOutput
    from pagedllm.sampling_params import SamplingParams

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    s = Scheduler(config, KVCacheManager(64, BS, kv_cache_groups=group_layers(specs("sf"))))
    prompt = list(range(1, 61))  # 60 tokens, then one more
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for req_id in ("a", "b"):
        s.add_request(EngineCoreRequest(req_id, prompt + [100], params, 0, 0.0))
        out = s.schedule()
        (new,) = out.scheduled_new_reqs
        s.update_from_output(out, ModelRunnerOutput([req_id], {req_id: 0}, [[5]]))
    # "b" hit the 7 full blocks of "a": all 7 in the full group, the window's 2 in the sliding one.
    assert new.num_computed_tokens == 56 and len(new.block_ids) == 2
    full_ids, sliding_ids = new.block_ids
    assert len(full_ids) == len(sliding_ids) == 8
    assert sliding_ids[:5] == [0] * 5 and 0 not in sliding_ids[5:] and 0 not in full_ids
    assert not s.kv_cache_manager.has_requests()
    s.kv_cache_manager.block_pool.check_integrity()
