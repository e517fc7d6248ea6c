"""The second KV tier end to end: a shared prefix evicted from a small KV cache comes back from
host RAM or disk with the same tokens as the cold run."""

from __future__ import annotations

import os
import time

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import check_block_accounting, kv_block_bytes, random_prompts

#: A KV cache of 24 blocks of 16 tokens: three 170-token prompts (11 blocks each) cannot all stay.
NUM_BLOCKS = 24


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]


def _tier_hits(llm: LLM) -> tuple[int, int]:
    """(tokens loaded from the second tier, blocks it holds)."""
    tier = llm.llm_engine.engine_core.kv_cache_manager.offloading
    return tier.num_loaded * 16, len(tier)


@pytest.mark.parametrize("where", ["ram", "disk"])
def test_evicted_prefix_comes_back_equal_to_the_cold_run(tiny_llama, tokenizer, tmp_path, where):
    path = str(tmp_path / "tier") if where == "disk" else None
    llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=NUM_BLOCKS, max_model_len=256,
              kv_offloading_size=0.01, kv_offloading_path=path)
    shared, other_a, other_b = random_prompts([170, 170, 170], len(tokenizer), seed=41)
    cold = _run(llm, [shared])
    _run(llm, [other_a])
    # other_b took the 2 blocks never used, then the shared prompt's from its tail: its
    # partial block and 8 of its 10 full blocks (stored; other_a's stay cached).
    _run(llm, [other_b])
    assert _tier_hits(llm) == (0, 8)
    if path is not None:  # one file per block, written by the tier's copy thread (off the step)
        (directory,) = os.listdir(path)
        deadline = time.monotonic() + 10
        while len(os.listdir(os.path.join(path, directory))) < 8:
            assert time.monotonic() < deadline, os.listdir(os.path.join(path, directory))
            time.sleep(0.01)
        assert len(os.listdir(os.path.join(path, directory))) == 8
    again = llm.generate({"prompt_token_ids": shared}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)[0]
    assert list(again.outputs[0].token_ids) == cold[0]
    assert again.num_cached_tokens == 160  # 2 blocks still in the cache, 8 from the tier
    assert _tier_hits(llm)[0] == 128
    stat_logger = llm.llm_engine.stat_logger
    assert stat_logger is None or stat_logger.external_prefix_cache_hit_rate > 0
    # Two requests sharing the reloaded prefix, and one cold: still the cold run's tokens.
    assert _run(llm, [shared, other_a])[0] == cold[0]
    check_block_accounting(llm)
    llm.llm_engine.engine_core.shutdown()  # what a server's engine process runs at exit
    assert path is None or os.listdir(path) == []  # the tier's directory is removed


def test_the_tier_keeps_only_its_size(tiny_llama, tokenizer):
    probe = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=NUM_BLOCKS, max_model_len=256)
    tier_bytes = 4 * kv_block_bytes(probe)
    del probe
    llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=NUM_BLOCKS, max_model_len=256,
              kv_offloading_size=tier_bytes / 2**30)
    shared, other_a, other_b = random_prompts([170, 170, 170], len(tokenizer), seed=41)
    cold = _run(llm, [shared])
    _run(llm, [other_a])
    _run(llm, [other_b])
    tier = llm.llm_engine.engine_core.kv_cache_manager.offloading
    assert tier.num_blocks == 4 and len(tier) == 4 and tier.num_stored == 8 and tier.num_dropped == 4
    # Stored tail first, the tier kept the prefix's blocks 2 .. 5 (0 and 1 are still cached):
    # 6 blocks are hits, the other 4 full blocks are computed again.
    again = llm.generate({"prompt_token_ids": shared}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)[0]
    assert list(again.outputs[0].token_ids) == cold[0] and again.num_cached_tokens == 96
    assert _tier_hits(llm)[0] == 64
    check_block_accounting(llm)


def test_a_tier_larger_than_the_free_ram_or_disk_is_refused(tmp_path):
    import shutil

    import psutil

    from pagedllm.engine.core import check_offloading_fits

    ram = psutil.virtual_memory().available
    with pytest.raises(ValueError, match="more than the .* GiB of host RAM available"):
        check_offloading_fits(None, 2 * ram)
    check_offloading_fits(None, 2**20)
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match=f"of free space under {tmp_path}; pass a smaller --kv-offloading-size"):
        check_offloading_fits(str(tmp_path / "not" / "made"), 2 * free)
    check_offloading_fits(str(tmp_path / "not" / "made"), 2**20)
    assert not (tmp_path / "not").exists()
