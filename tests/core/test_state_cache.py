"""The state cache beside the paged KV cache: state layers grouped apart from attention
layers, one slot per request per state group taken at admission and returned at finish,
abort and preemption (and reused), admission refused when no slot is free, prefix hits
that end where a state is saved, and the sizing that sets the slots' bytes aside before it
buys attention blocks."""

from __future__ import annotations

import logging

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_interface import FullAttentionSpec, MambaSpec, group_layers, layer_kv_cache_specs
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.worker.kv_cache_sizing import KVCacheBudget
from tests.core.test_kv_cache_manager import make_request
from tests.core.test_scheduler import add, fake_run
from tests.helpers import check_state_slot_accounting


class _Bytes:
    """A dtype stand-in (core is plain Python): ``itemsize`` bytes per element."""

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize


F32 = _Bytes(4)
BS = 4
STATE = MambaSpec(((24, 3), (2, 8, 16)), (F32, F32))  # conv (conv_dim, width - 1), ssm (nheads, head_dim, d_state)
FULL = FullAttentionSpec(BS, 2, 16, 4)


def bamba_groups(kinds: str = "mmfm"):
    """'m' a state layer, 'f' full attention, one letter per layer."""
    states = {i: STATE for i, k in enumerate(kinds) if k == "m"}
    return group_layers(layer_kv_cache_specs([None] * len(kinds), BS, 2, 16, 4, state_specs=states))


def test_state_layers_form_their_own_group_after_the_attention_groups():
    groups = bamba_groups("mmfm")
    assert [(g.layer_indices, g.kv_cache_spec) for g in groups.groups] == [((2,), FULL)]
    assert [(g.layer_indices, g.kv_cache_spec) for g in groups.state_groups] == [((0, 1, 3), STATE)]
    assert groups.num_groups == 2 and groups.state_group_of_layer() == {0: 1, 1: 1, 3: 1}
    assert STATE.page_size_bytes == (24 * 3 + 2 * 8 * 16) * 4
    assert groups.state_bytes_per_request == 3 * STATE.page_size_bytes
    pure = bamba_groups("mm")
    assert pure.groups == () and pure.block_size is None and pure.block_bytes == 0
    # No state layer: exactly the attention layout of before.
    assert bamba_groups("ff") == group_layers([FULL, FULL]) and not group_layers([FULL]).state_groups


def test_a_slot_per_request_is_taken_at_admission_and_freed_and_reused():
    manager = KVCacheManager(16, BS, enable_caching=False, kv_cache_groups=bamba_groups(), num_state_slots=2)
    a, b, c = (make_request(r, list(range(10))) for r in "abc")
    new_a = manager.allocate_slots(a, 10)
    assert new_a is not None
    blocks, slot = new_a.get_block_ids()
    assert len(blocks) == 3 and len(slot) == 1
    a.num_computed_tokens = 10
    assert manager.allocate_slots(a, 1).get_block_ids()[1] == []  # the slot is kept, not taken again
    assert manager.allocate_slots(b, 10) is not None
    free_blocks = manager.block_pool.get_num_free_blocks()
    assert manager.allocate_slots(c, 10) is None, "admitted without a free state slot"
    assert manager.block_pool.get_num_free_blocks() == free_blocks, "a refused admission allocated blocks"
    check_state_slot_accounting(manager, {"a", "b"})
    manager.free(a)
    assert manager.get_block_ids("a") == ([], [])
    assert manager.allocate_slots(c, 10).get_block_ids()[1] == slot, "the freed slot is not reused"
    check_state_slot_accounting(manager, {"b", "c"})


def test_prefix_hits_end_where_a_state_is_saved():
    """A state is saved at a request's last block boundary (its chunk cut there), registered
    once its step ran, kept when it finishes; a later request hits it there, and only there."""
    manager = KVCacheManager(32, BS, enable_caching=True, kv_cache_groups=bamba_groups(), num_state_slots=6)
    tokens = list(range(1, 15))  # 14 tokens: the save point is 12
    a = make_request("a", tokens)
    assert manager.align_to_save_point(a, 0, 14) == 12 and manager.align_to_save_point(a, 12, 2) == 2
    hits, num_hit = manager.get_computed_blocks(a)
    assert num_hit == 0
    blocks, state = manager.allocate_slots(a, 12, hits).get_block_ids()
    assert len(state) == 2  # the working slot, and the slot the state at 12 is saved into
    early = make_request("early", tokens)  # admitted before a's step ran: no state saved yet
    assert manager.get_computed_blocks(early)[1] == 0
    a.num_computed_tokens = 12  # the step ran
    assert manager.allocate_slots(a, 2).get_block_ids()[1] == []
    a.num_computed_tokens = 14
    manager.free(a)
    check_state_slot_accounting(manager, set())
    same = make_request("same", tokens + [99])
    hits, num_hit = manager.get_computed_blocks(same)
    assert num_hit == 12 and hits.get_block_ids()[1][-1] == state[1], "the saved state is not hit"
    new_state = manager.allocate_slots(same, 3, hits).get_block_ids()[1]
    assert new_state[1] == state[1] and new_state[0] != state[1]  # a working slot, then the hit's
    # The KV of its first 8 tokens is cached, but no state is saved at 4 or 8: no hit.
    shorter = make_request("shorter", tokens[:10] + [77, 78])
    assert manager.get_computed_blocks(shorter)[1] == 0
    assert len(manager.managers[0].find_longest_cache_hit(shorter.block_hashes, 8)) == 2
    check_state_slot_accounting(manager, {"same"})


def test_scheduler_frees_slots_at_finish_abort_and_preemption():
    # 6 blocks of 4 tokens: two 10-token prompts fit (3 blocks each), their decodes do not.
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64)
    manager = KVCacheManager(6, BS, enable_caching=False, kv_cache_groups=bamba_groups(), num_state_slots=3)
    s = Scheduler(config, manager)
    for r in "abc":
        add(s, r, 10, max_tokens=6)
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b"}  # c waits for blocks
    check_state_slot_accounting(manager, {"a", "b"})
    fake_run(s, out)
    while not s.num_preemptions:  # 13 tokens need a 4th block: b is preempted, its slot freed
        out = s.schedule()
        check_state_slot_accounting(manager, {r.request_id for r in s.running})
        if not s.num_preemptions:
            fake_run(s, out)
    assert s.requests["b"].status == RequestStatus.PREEMPTED and manager.get_block_ids("b") == ([], [])
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)  # aborted while waiting: held nothing
    fake_run(s, out)
    while s.has_unfinished_requests():
        fake_run(s, s.schedule())
        check_state_slot_accounting(manager, {r.request_id for r in s.running})
    assert not manager.has_requests()


def test_sizing_sets_the_state_bytes_aside_and_logs_the_slots(caplog):
    from pagedllm.config import EngineArgs
    from pagedllm.worker.kv_cache_sizing import kv_bytes_per_block, num_kv_blocks

    # The packaged model's layout with its first layer a state layer instead.
    config = EngineArgs(model=None, dtype="float32", block_size=8, max_model_len=64).create_engine_config()
    model_config, cache_config = config.model_config, config.cache_config
    groups = group_layers(layer_kv_cache_specs(
        [None] * model_config.num_layers, 8, model_config.num_kv_heads, model_config.head_dim, 4,
        state_specs={0: STATE}))
    per_block = kv_bytes_per_block(model_config, groups)
    budget = KVCacheBudget(100 * per_block, "a test budget")
    state_bytes = 10 * groups.state_bytes_per_request
    with caplog.at_level(logging.INFO, logger="pagedllm.worker.kv_cache_sizing"):
        with_slots = num_kv_blocks(model_config, cache_config, budget, groups=groups, num_state_slots=10)
    assert with_slots == (100 * per_block - state_bytes) // per_block < 100
    assert f"state: 10 slots of {groups.state_bytes_per_request:,} bytes" in caplog.text
    too_small = KVCacheBudget(state_bytes - 1, "a tiny budget")
    with pytest.raises(ValueError, match="cannot hold the recurrent states of max_num_seqs = 10 requests"):
        num_kv_blocks(model_config, cache_config, too_small, groups=groups, num_state_slots=10)
    with pytest.raises(ValueError, match="one sequence of max_model_len = 64 tokens.*less state: 10 slots"):
        num_kv_blocks(model_config, cache_config, KVCacheBudget(state_bytes + per_block, "a small budget"),
                      groups=groups, num_state_slots=10)
    assert num_kv_blocks(model_config, cache_config, budget, groups=bamba_groups("mm"), num_state_slots=10) == 0


def test_a_pipeline_stage_counts_its_own_state_layers():
    groups = bamba_groups("mmfm")
    page = STATE.page_size_bytes
    assert [groups.stage_state_bytes_per_request(*r) for r in ((0, 2), (2, 4), (2, 3), (0, 4))] == [
        2 * page, page, 0, groups.state_bytes_per_request]


def test_a_pipeline_stage_sizes_its_blocks_after_its_own_states(monkeypatch, caplog):
    """Layer 0 a state layer, the others attention: the stage of layer 0 alone stores no block
    (``NO_BLOCK_LIMIT``: the other stage decides), the stage of the others sets no state aside."""
    from pagedllm.config import EngineArgs
    from pagedllm.worker import kv_cache_sizing
    from pagedllm.worker.kv_cache_sizing import NO_BLOCK_LIMIT, kv_bytes_per_block, num_kv_blocks

    config = EngineArgs(model=None, dtype="float32", block_size=8, max_model_len=64).create_engine_config()
    model_config, cache_config = config.model_config, config.cache_config
    num_layers = model_config.num_layers
    groups = group_layers(layer_kv_cache_specs(
        [None] * num_layers, 8, model_config.num_kv_heads, model_config.head_dim, 4, state_specs={0: STATE}))
    monkeypatch.setattr(kv_cache_sizing, "stage_layer_range", lambda _: (0, 1))
    with caplog.at_level(logging.INFO, logger="pagedllm.worker.kv_cache_sizing"):
        assert num_kv_blocks(model_config, cache_config, KVCacheBudget(1 << 20, "a test budget"), groups=groups,
                             num_state_slots=10) == NO_BLOCK_LIMIT
    assert "none on this pipeline stage (layers 0 .. 0 hold no attention)" in caplog.text
    assert f"state: 10 slots of {STATE.page_size_bytes:,} bytes" in caplog.text
    monkeypatch.setattr(kv_cache_sizing, "stage_layer_range", lambda _: (1, num_layers))
    per_block = kv_bytes_per_block(model_config, groups)
    assert num_kv_blocks(model_config, cache_config, KVCacheBudget(100 * per_block, "a test budget"), groups=groups,
                         num_state_slots=10) == 100
