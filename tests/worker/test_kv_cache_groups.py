"""A model with full-attention and sliding-window layers served through KV-cache groups: a
Qwen2 of 4 layers (sliding, full, sliding, sliding; window 16, blocks of 8), prompts and
generations far past the window. Greedy output token-identical to transformers float32
under chunked prefill crossing window boundaries, with a warm prefix-cache run equal to the
cold one, under preemption, with a draft model (lookahead slots in every group; the draft
writes through the full-attention group's table) and with two pipeline stages (each
allocating its layers' share of the shared cache tensors); the KV-cache sizing of the same
budget against the model's all-full-attention variant."""

from __future__ import annotations

import logging
import re

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_interface import cdiv
from pagedllm.worker.kv_cache_sizing import kv_cache_budget, kv_cache_groups, num_kv_blocks
from tests.helpers import (
    can_host_workers,
    check_block_accounting,
    cpu_only,
    float32_llm,
    hf_greedy,
    model_runner,
    random_prompts,
)

WINDOW, BLOCK = 16, 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
MAX_TOKENS = 20
#: Far past the window, one ending just after it, one whose chunks end on block boundaries.
PROMPT_LENGTHS = [60, WINDOW + 1, 32]
BASE = {"attention_backend": "TORCH_SDPA", "block_size": BLOCK}
#: Both backends (each must keep freed blocks before a query's window out of its output).
BACKENDS = ["TORCH_SDPA", pytest.param("CPU_ATTN", marks=cpu_only)]

_references: dict = {}


def _checkpoint(checkpoint_factory, layer_types=LAYER_TYPES):
    return checkpoint_factory("Qwen2ForCausalLM", num_hidden_layers=4, use_sliding_window=True,
                              sliding_window=WINDOW, layer_types=layer_types, seed=41)


@pytest.fixture(scope="module")
def hybrid(checkpoint_factory):
    return _checkpoint(checkpoint_factory)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return random_prompts(PROMPT_LENGTHS, len(tokenizer), seed=7)


def _expected(path, prompts):
    if str(path) not in _references:
        _references[str(path)] = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    return _references[str(path)]


def _generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_and_prefix_hits_match_transformers(hybrid, prompts, backend):
    expected = _expected(hybrid, prompts)
    llm = float32_llm(hybrid, {**BASE, "attention_backend": backend, "max_num_batched_tokens": 8})  # chunks of 8 cross the window's edge
    runner = model_runner(llm)
    groups = llm.llm_engine.engine_core.kv_cache_manager.kv_cache_groups
    assert [(g.layer_indices, getattr(g.kv_cache_spec, "sliding_window", None)) for g in groups.groups] == [
        ((1,), None), ((0,), WINDOW), ((2,), WINDOW), ((3,), WINDOW)]
    assert [layer.kv_cache_group_id for layer in runner.attention_layers] == [1, 0, 2, 3]
    # One cache tensor shared by the 4 groups' layers, its null block zeroed.
    assert len({layer.kv_cache.data_ptr() for layer in runner.attention_layers}) == 1
    assert not runner.attention_layers[0].kv_cache[:, 0].any()
    cold = _generate(llm, prompts)
    warm = _generate(llm, prompts)
    for prompt, c, w, ref in zip(prompts, cold, warm, expected):
        assert c.outputs[0].token_ids == ref, f"cold: prompt of {len(prompt)} tokens diverged"
        assert w.outputs[0].token_ids == ref, f"warm: prompt of {len(prompt)} tokens diverged"
    # The warm 60-token prompt hit all its full blocks: in the sliding groups only the
    # window's before token 56 were needed.
    assert warm[0].num_cached_tokens == 56 and cold[0].num_cached_tokens == 0
    check_block_accounting(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_matches_transformers(hybrid, prompts, backend):
    expected = _expected(hybrid, prompts)
    # 32 blocks of 8 tokens shared by 4 groups (one request needs at most 12 + 3 x 5, and
    # the null block): the batch needs more, so requests are preempted.
    llm = float32_llm(hybrid, {**BASE, "attention_backend": backend, "max_model_len": 96, "max_num_batched_tokens": 16,
                               "num_gpu_blocks_override": 32})
    outputs = _generate(llm, prompts)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for prompt, output, ref in zip(prompts, outputs, expected):
        assert output.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
    check_block_accounting(llm)


def test_groups_of_two_layers_with_padding_match_transformers(checkpoint_factory, prompts):
    """5 layers, 3 sliding : 2 full: groups of 2 ((2, 4) full, (0, 3) and (1,) sliding, the
    last padded), so 2 cache tensors, each shared by one layer of every group."""
    path = checkpoint_factory("Qwen2ForCausalLM", num_hidden_layers=5, use_sliding_window=True, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention", "full_attention"], seed=43)
    expected = _expected(path, prompts)
    llm = float32_llm(path, {**BASE, "max_num_batched_tokens": 16})
    groups = llm.llm_engine.engine_core.kv_cache_manager.kv_cache_groups
    assert [g.layer_indices for g in groups.groups] == [(2, 4), (0, 3), (1,)] and groups.group_size == 2
    caches = [layer.kv_cache.data_ptr() for layer in model_runner(llm).attention_layers]
    assert caches[0] == caches[1] == caches[2] != caches[3] == caches[4]
    for run in range(2):
        outputs = _generate(llm, prompts)
        for prompt, output, ref in zip(prompts, outputs, expected):
            assert output.outputs[0].token_ids == ref, f"run {run}: prompt of {len(prompt)} tokens diverged"
    assert outputs[0].num_cached_tokens == 56
    check_block_accounting(llm)


def test_draft_model_matches_transformers(hybrid, prompts):
    expected = _expected(hybrid, prompts)
    llm = float32_llm(hybrid, {**BASE, "max_num_batched_tokens": 16,
                               "speculative_config": {"model": str(hybrid), "num_speculative_tokens": 3}})
    outputs = _generate(llm, prompts)
    for prompt, output, ref in zip(prompts, outputs, expected):
        assert output.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
    check_block_accounting(llm)


@pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")
def test_two_pipeline_stages_match_transformers(hybrid, prompts):
    expected = _expected(hybrid, prompts)
    llm = float32_llm(hybrid, {**BASE, "max_num_batched_tokens": 16, "pipeline_parallel_size": 2})
    try:
        outputs = _generate(llm, prompts)
        for prompt, output, ref in zip(prompts, outputs, expected):
            assert output.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
        check_block_accounting(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_same_budget_admits_more_long_requests_than_all_full_attention(checkpoint_factory, caplog):
    """Blocks of the mostly-sliding model take one layer's page (4 groups of 1 layer share
    one tensor), the all-full variant's four; a 2048-token request needs 256 blocks in a
    full-attention group, at most cdiv(W - 1 + chunk, 8) + 1 in a sliding one. The start-up
    line's maximum concurrency counts those needs."""
    budget, chunk = 16 << 20, 64
    concurrency, need, lines = {}, {}, {}
    for name, layer_types in {"hybrid": LAYER_TYPES, "full": ["full_attention"] * 4}.items():
        config = EngineArgs(model=str(_checkpoint(checkpoint_factory, layer_types)), dtype="float32",
                            block_size=BLOCK, kv_cache_memory_bytes=budget, max_num_batched_tokens=chunk,
                            attention_backend="TORCH_SDPA").create_engine_config()
        groups = kv_cache_groups(config)
        need[name] = groups.max_num_blocks_per_request(2048, chunk)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagedllm.worker.kv_cache_sizing"):
            num_blocks = num_kv_blocks(config.model_config, config.cache_config,
                                       kv_cache_budget(config.cache_config, 0, 0, 0), None, groups, chunk)
        assert num_blocks == budget // groups.block_bytes
        concurrency[name] = (num_blocks - groups.has_sliding_window) / need[name]
        lines[name] = caplog.text
        logged = re.search(r"maximum concurrency for 2048 tokens per request: ([0-9.]+)x", caplog.text)
        assert float(logged.group(1)) == pytest.approx(concurrency[name], abs=0.01)
    per_group = (budget // (2 * BLOCK * 2 * 16 * 4) - 1) // 4 * BLOCK  # the usable blocks split evenly
    assert f"full attention: {per_group} tokens; sliding window 16: {per_group} tokens in each of 3 groups" in lines["hybrid"]
    assert f"full attention: {budget // (2 * BLOCK * 2 * 16 * 4 * 4) * BLOCK} tokens)" in lines["full"]
    assert need["full"] == 256 and need["hybrid"] == 256 + 3 * (cdiv(WINDOW - 1 + chunk, BLOCK) + 1)
    ratio = concurrency["hybrid"] / concurrency["full"]
    assert ratio == pytest.approx(4 * 256 / (256 + 3 * 11), rel=1e-3)  # 3.5x the concurrent 2048-token requests


def test_num_gpu_blocks_override_must_hold_one_sequence_in_every_group(hybrid):
    """max_model_len 96, 16-token steps: one request holds 12 full-attention blocks and 5 in
    each of the 3 sliding groups, and the null block is set aside: 28. An override of 27 passes
    the flag's own check (12 blocks) but is a start-up error naming the numbers; 28 serves a
    request of max_model_len tokens (transformers' tokens) instead of leaving it waiting."""
    kwargs = {**BASE, "max_model_len": 96, "max_num_batched_tokens": 16}
    with pytest.raises(ValueError, match=re.escape(
            "num_gpu_blocks_override=27 cannot hold one sequence of max_model_len = 96 tokens across the model's 4 "
            "KV-cache groups: that needs 12 (full attention) + 5 (sliding window 16) + 5 (sliding window 16) + 5 "
            "(sliding window 16) + 1 (the null block) = 28 blocks of 8 tokens")):
        float32_llm(hybrid, {**kwargs, "num_gpu_blocks_override": 27})
    llm = float32_llm(hybrid, {**kwargs, "num_gpu_blocks_override": 28})
    prompt = random_prompts([90], 1000, seed=4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(hybrid, prompt, 6)
    check_block_accounting(llm)
