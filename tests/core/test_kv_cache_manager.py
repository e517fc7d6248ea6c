"""Block tables, prefix-cache hits, LRU eviction and hashing (plain Python)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import HASH_FUNCTIONS
from pagedllm.core.request import Request
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

BS = 16


def make_request(req_id: str, tokens: list[int], cache_salt=None, **params) -> Request:
    core_req = EngineCoreRequest(req_id, tokens, SamplingParams(**params), 0, 0.0, cache_salt)
    return Request(core_req, max_model_len=4096)


def table(manager: KVCacheManager, req_id: str) -> list:
    """The request's blocks in the one group of a full-attention model."""
    return manager.get_blocks(req_id).blocks[0]


def admit(manager: KVCacheManager, request: Request) -> int:
    """Admit like the scheduler does; returns the number of prefix-cache hit tokens."""
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit


@pytest.mark.parametrize("algo", sorted(HASH_FUNCTIONS))
def test_hits_count_whole_blocks_and_never_the_last_token(algo):
    manager = KVCacheManager(64, BS, hash_algo=algo)
    prefix = list(range(100, 200))  # 100 tokens
    first = make_request("a", prefix + [1, 2, 3])
    assert admit(manager, first) == 0
    second = make_request("b", prefix + [7, 8])
    assert admit(manager, second) == 96
    assert table(manager, "b")[:6] == table(manager, "a")[:6]
    exact = list(range(300, 364))  # 64 tokens, exactly 4 blocks
    assert admit(manager, make_request("c", exact)) == 0
    assert admit(manager, make_request("d", exact)) == 48
    assert manager.prefix_cache_queries == 103 + 102 + 64 + 64
    assert manager.prefix_cache_hits == 96 + 48
    manager.block_pool.check_integrity()


def test_cache_salt_isolates_and_same_salt_shares():
    manager = KVCacheManager(64, BS)
    tokens = list(range(40))
    assert admit(manager, make_request("a", tokens, cache_salt="tenant-1")) == 0
    assert admit(manager, make_request("b", tokens, cache_salt="tenant-2")) == 0
    assert admit(manager, make_request("c", tokens)) == 0
    assert admit(manager, make_request("d", tokens, cache_salt="tenant-1")) == 32
    ids = {r: set(b.block_id for b in table(manager, r)) for r in "abcd"}
    assert not ids["a"] & ids["b"] and not ids["a"] & ids["c"] and not ids["b"] & ids["c"]
    assert len(ids["a"] & ids["d"]) == 2


def test_freed_blocks_stay_findable_and_lru_evicts_chain_tails_first():
    manager = KVCacheManager(8, BS)
    old = make_request("old", list(range(48)) + [999])  # 3 full blocks + 1 partial
    admit(manager, old)
    old_blocks = table(manager, "old")
    manager.free(old)
    # Freed in reverse: the partial tail block, then block 2, 1, 0 (the chain's head last).
    free_order = [b.block_id for b in manager.block_pool.free_block_queue]
    assert free_order[-4:] == [b.block_id for b in reversed(old_blocks)]
    # Still findable.
    again = make_request("again", list(range(48)) + [5])
    assert admit(manager, again) == 48
    manager.free(again)
    # Pressure: a request needing 6 of the 8 blocks takes the 5 blocks that hold no
    # cached prefix first (LRU head), then the tail of the cached chain (block 2); the
    # chain's head blocks 0 and 1 stay findable.
    admit(manager, make_request("new", list(range(1000, 1000 + 6 * BS - 1))))
    evicted = [b for b in old_blocks[:3] if b.block_hash is None]
    assert evicted == [old_blocks[2]]
    probe = make_request("probe", list(range(48)) + [1])
    hits, num = manager.get_computed_blocks(probe)
    assert num == 32 and hits.blocks[0] == old_blocks[:2]
    manager.block_pool.check_integrity()


def test_blocks_in_use_are_never_evicted():
    manager = KVCacheManager(4, BS)
    holder = make_request("holder", list(range(33)))  # 3 blocks, in use
    admit(manager, holder)
    assert manager.allocate_slots(make_request("big", list(range(500, 540))), 40) is None
    assert all(b.ref_cnt == 1 for b in table(manager, "holder"))
    manager.block_pool.check_integrity()


def test_a_shared_block_is_never_written():
    manager = KVCacheManager(16, BS)
    a = make_request("a", list(range(40)))
    admit(manager, a)
    b = make_request("b", list(range(32)) + [77, 78])
    assert admit(manager, b) == 32
    shared = table(manager, "a")[:2]
    assert all(block.ref_cnt == 2 for block in shared)
    # b computes from token 32 on: its writes go to blocks it owns alone.
    assert table(manager, "b")[2].ref_cnt == 1


def test_disabled_caching_never_hits():
    manager = KVCacheManager(16, BS, enable_caching=False)
    tokens = list(range(40))
    assert admit(manager, make_request("a", tokens)) == 0
    manager.free(make_request("a", tokens))
    assert admit(manager, make_request("b", tokens)) == 0
    assert not manager.block_pool.cached_block_hash_to_block


_CBOR_SCRIPT = """
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
m = KVCacheManager(8, 16, hash_algo="sha256_cbor")
r = Request(EngineCoreRequest("x", list(range(40)), SamplingParams(), 0, 0.0, "salt"), 4096)
m.get_computed_blocks(r)
print(",".join(h.hex() for h in r.block_hashes))
"""


def test_sha256_cbor_hashes_are_identical_across_processes():
    runs = [
        subprocess.run([sys.executable, "-c", _CBOR_SCRIPT], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.strip()
        for seed in ("random", "random")
    ]
    assert runs[0] == runs[1] and len(runs[0].split(",")) == 2


def test_lookahead_slots_get_blocks_that_are_never_cached():
    manager = KVCacheManager(16, BS)
    request = make_request("a", list(range(40)))  # 2 full blocks + 8 tokens
    blocks = manager.allocate_slots(request, 40, num_lookahead_tokens=30).blocks[0]
    assert len(blocks) == 5  # ceil(70 / 16): 3 for the tokens, 2 more for the lookahead
    request.num_computed_tokens = 40
    # Only the two full blocks of real tokens are hashed; the block that the tokens
    # share with lookahead slots, and the lookahead-only ones, are not.
    assert [b.block_hash is not None for b in blocks] == [True, True, False, False, False]
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    # The reserved slots cover the next decode steps: no new block until token 70.
    request.append_output_token_id(1)
    assert manager.allocate_slots(request, 1, num_lookahead_tokens=29).blocks == ([],)
    manager.free(request)
    manager.block_pool.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == 16


def test_lookahead_counts_against_free_blocks():
    manager = KVCacheManager(4, BS)
    request = make_request("a", list(range(40)))
    assert manager.allocate_slots(request, 40, num_lookahead_tokens=25) is None  # needs 5
    assert not manager.has_requests()
    assert len(manager.allocate_slots(request, 40, num_lookahead_tokens=24).blocks[0]) == 4
    manager.block_pool.check_integrity()
