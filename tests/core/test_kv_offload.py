"""The second KV tier's index and its use by the KV-cache manager and the scheduler (plain Python)."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.config.cache import CacheConfig
from pagedllm.core.kv_cache_interface import FullAttentionSpec, KVCacheGroups, KVCacheGroupSpec, SlidingWindowSpec
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import BlockHash
from pagedllm.core.kv_offload import OffloadingManager
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.messages.runner_output import ModelRunnerOutput
from pagedllm.messages.sched_output import DROP, LOAD, STORE, KVTransfer, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

BS = 4


def key(i: int) -> BlockHash:
    return BlockHash(bytes([i]))


def test_lru_limit_drops_the_least_recent_and_hits_refresh():
    tier = OffloadingManager(3)
    for i in range(3):
        tier.store(10 + i, key(i))
    tier.load("r", [key(0)], [5])  # key 0 is now the most recent
    tier.store(13, key(3))  # over the limit: key 1 goes
    tier.store(14, key(0))  # held already: no second store
    assert len(tier) == 3 and key(1) not in tier
    assert tier.lookup([key(0), key(2), key(3)]) == 3
    assert tier.lookup([key(0), key(1), key(2)]) == 1  # the leading run only
    assert tier.take_transfers() == [
        KVTransfer(STORE, key(0), 10), KVTransfer(STORE, key(1), 11), KVTransfer(STORE, key(2), 12),
        KVTransfer(LOAD, key(0), 5, "r"), KVTransfer(STORE, key(3), 13), KVTransfer(DROP, key(1)),
    ]
    assert tier.take_transfers() == []
    assert (tier.num_stored, tier.num_loaded, tier.num_dropped) == (4, 1, 1)
    with pytest.raises(ValueError, match="at least one block"):
        OffloadingManager(0)


def test_pinned_hits_survive_the_stores_of_their_own_allocation():
    tier = OffloadingManager(2)
    tier.store(1, key(1))
    tier.store(2, key(2))
    tier.pin([key(1), key(2)])  # both about to be loaded
    tier.store(3, key(3))  # all others pinned: the new key itself goes
    assert key(1) in tier and key(2) in tier and key(3) not in tier
    assert tier.take_transfers()[-2:] == [KVTransfer(STORE, key(3), 3), KVTransfer(DROP, key(3))]
    tier.store(4, key(4))  # the pins ended with the step: the least recent goes
    assert key(1) not in tier and key(4) in tier


def request(req_id: str, tokens: list[int], max_tokens: int = 2):
    return EngineCoreRequest(req_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, 0.0)


def run_step(scheduler: Scheduler, finished_recving=()) -> SchedulerOutput:
    """A fake step: each request whose known tokens are all computed samples token 7."""
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[r].num_computed_tokens == scheduler.requests[r].num_tokens else []
               for r in req_ids]
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled,
                                                        finished_recving=set(finished_recving)))
    return out


def make_scheduler(num_blocks: int = 10, tier_blocks: int = 16) -> Scheduler:
    manager = KVCacheManager(num_blocks, BS, offloading=OffloadingManager(tier_blocks))
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40), manager)


def finish(scheduler: Scheduler, req_id: str, tokens: list[int]) -> list[KVTransfer]:
    """Run a request to its end; the tier transfers its steps sent."""
    scheduler.add_request(request(req_id, tokens))
    transfers = []
    while req_id in scheduler.requests:
        transfers += run_step(scheduler).kv_transfers
    return transfers


def test_evicted_prefix_is_stored_then_loaded_before_the_request_runs():
    s = make_scheduler()
    manager, tier = s.kv_cache_manager, s.kv_cache_manager.offloading
    prefix = list(range(100, 117))  # 17 tokens: 4 full blocks
    assert finish(s, "a", prefix) == []  # nothing evicted: a's blocks stay cached
    # b's 9 blocks (33 + 2 tokens) take the 5 never used, then a's from its tail: 3 of its
    # 4 full blocks are stored (its partial tail block has no hash).
    stores = finish(s, "b", list(range(200, 233)))
    assert [t.kind for t in stores] == [STORE] * 3 and len(tier) == 3
    s.add_request(request("c", prefix))
    out = s.schedule()
    loads = [t for t in out.kv_transfers if t.kind == LOAD]
    assert out.num_scheduled_tokens == {} and [t.block_hash for t in loads] == [t.block_hash for t in reversed(stores)]
    c = s.requests["c"]
    assert c.status == RequestStatus.WAITING_FOR_REMOTE_KVS and c.num_computed_tokens == 16
    blocks = manager.get_blocks("c").blocks[0]
    assert [t.block_id for t in loads] == [b.block_id for b in blocks[1:]]  # block 0 was still cached
    assert all(b.block_hash is None for b in blocks[1:])  # not hittable while loading
    stats = s.make_stats()
    assert (stats.prefix_cache_hits, stats.external_prefix_cache_hits, stats.external_prefix_cache_queries) == (4, 12, 17)
    run_step(s)  # the load is not written yet: c waits
    assert c.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out = run_step(s, finished_recving={"c"})  # reported: c runs its last token in the next step
    assert out.num_scheduled_tokens == {}
    out = run_step(s)
    assert out.num_scheduled_tokens == {"c": 1} and out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert all(b.block_hash is not None for b in manager.get_blocks("c").blocks[0][:4])
    while s.has_unfinished_requests():
        run_step(s)
    manager.block_pool.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == 10 and not manager.has_requests()


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_is_written():
    s = make_scheduler()
    prefix = list(range(100, 117))
    finish(s, "a", prefix)
    finish(s, "b", list(range(200, 233)))
    s.add_request(request("c", prefix))
    run_step(s)
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 10 - 4 and s.has_unfinished_requests()
    run_step(s, finished_recving={"c"})
    assert not s.has_unfinished_requests() and "c" not in s.requests
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 10
    s.kv_cache_manager.block_pool.check_integrity()


def test_reset_prefix_cache_drops_the_tier_too():
    s = make_scheduler()
    finish(s, "a", list(range(100, 117)))
    finish(s, "b", list(range(200, 233)))
    assert s.kv_cache_manager.reset_prefix_cache()
    assert len(s.kv_cache_manager.offloading) == 0
    assert [t.kind for t in s.kv_cache_manager.take_kv_transfers()] == [DROP] * 3


def test_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="needs prefix caching"):
        KVCacheManager(8, BS, enable_caching=False, offloading=OffloadingManager(4))
    sliding = KVCacheGroups((KVCacheGroupSpec((0,), FullAttentionSpec(BS, 1, 1, 4)),
                             KVCacheGroupSpec((1,), SlidingWindowSpec(BS, 1, 1, 4, 8))), 2)
    with pytest.raises(ValueError, match="attend fully"):
        KVCacheManager(8, BS, kv_cache_groups=sliding, offloading=OffloadingManager(4))
    fields = dict(block_size=16, gpu_memory_utilization=0.9, kv_cache_memory_bytes=None,
                  prefix_caching_hash_algo="sha256")
    with pytest.raises(ValueError, match="needs prefix caching"):
        CacheConfig(enable_prefix_caching=False, kv_offloading_size=1.0, **fields)
    with pytest.raises(ValueError, match="needs kv_offloading_size"):
        CacheConfig(enable_prefix_caching=True, kv_offloading_path="/tmp", **fields)
