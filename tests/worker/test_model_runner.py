"""The KV cache is never cleared: blocks handed to a request, and the block tables' padding,
may hold anything a block held before (here NaN). The CPU kernel reads no slot past a
request's context, and the portable attention zeroes the values it gathered there, so the
greedy output equals a clean cache's either way."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.helpers import model_runner, random_prompts


@pytest.mark.parametrize("kernels", [True, False])
def test_stale_nan_in_fresh_blocks_never_reaches_outputs(kernels, tiny_qwen2, tokenizer, monkeypatch):
    if not kernels:
        monkeypatch.setenv("PAGEDLLM_DISABLE_CPU_KERNELS", "1")
    prompts = random_prompts([5, 21, 40], len(tokenizer), seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(tiny_qwen2), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=16)
    runner = model_runner(llm)
    assert runner.prefill_as_decode is kernels
    clean = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm.llm_engine.reset_prefix_cache()
    for cache in runner.kv_caches:
        cache.fill_(float("nan"))
    again = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert again == clean
    assert bool(runner.kv_caches[0].isnan().any())  # nothing cleared the unused slots
