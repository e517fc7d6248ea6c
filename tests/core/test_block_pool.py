"""BlockPool and its LRU free queue (plain Python)."""

import pytest

from pagedllm.core.block_pool import BlockPool


def test_new_blocks_come_from_the_head_and_freed_ones_go_to_the_tail():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1] and all(b.ref_cnt == 1 for b in a)
    pool.free_blocks(reversed(a))
    assert [b.block_id for b in pool.free_block_queue] == [2, 3, 4, 5, 1, 0]
    pool.check_integrity()


def test_touch_removes_a_free_block_from_the_middle():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks)
    pool.touch([blocks[2]])
    assert [b.block_id for b in pool.free_block_queue] == [0, 1, 3]
    assert blocks[2].ref_cnt == 1
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 2 and pool.get_num_free_blocks() == 3
    pool.check_integrity()


def test_eviction_drops_the_hash():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h1")
    pool.free_blocks([block])
    assert pool.get_cached_block(b"h1") is block
    pool.get_new_blocks(2)
    assert pool.get_cached_block(b"h1") is None and block.block_hash is None
    pool.check_integrity()


def test_too_many_blocks_is_a_clear_error():
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(ValueError, match="Cannot get 3 free blocks; only 2 are free"):
        pool.get_new_blocks(3)


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h")
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"h") is block
    pool.free_blocks([block])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"h") is None
