"""The priority scheduling policy end to end (``LLM(scheduling_policy="priority")``,
``generate(priority=...)``): with preemption and prefix caching, with LoRA adapters and
with n-gram speculative decoding, greedy outputs equal transformers' float32 ones."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.processor import Processor
from tests.helpers import check_block_accounting, float32_llm, hf_greedy, random_prompts
from tests.lora.conftest import peft_adapters  # noqa: F401 (fixture)
from tests.lora.test_lora_greedy_equality import _make_llm, _mixed_batch
from tests.spec_decode.test_spec_greedy_equality import record_spec_stats, spec_configs

MAX_TOKENS = 8


def _greedy(llm, prompts, priority):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, priority=priority)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_priority_with_prefix_caching_and_preemption_matches_transformers(tiny_llama, tokenizer):
    # 12 blocks of 8 tokens for five ~30-token prompts sharing a 16-token prefix: preemption.
    llm = float32_llm(tiny_llama, {"scheduling_policy": "priority", "block_size": 8, "kv_blocks": 12,
                                   "max_model_len": 96, "max_num_batched_tokens": 24})
    shared = random_prompts([16], len(tokenizer), seed=1)[0]
    prompts = [shared + tail for tail in random_prompts([13, 9, 17, 11, 14], len(tokenizer), seed=2)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, priority=[3, 0, 2, 1, 0])
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(tiny_llama, p, MAX_TOKENS) for p in prompts]
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert max(o.num_cached_tokens for o in outputs) >= 16, "the shared prefix is a cache hit"
    check_block_accounting(llm)
    # Under fcfs a priority other than 0 is refused (vLLM's rule), before anything is queued.
    fcfs = Processor(llm.llm_engine.model_config, llm.get_tokenizer(), scheduling_policy="fcfs")
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        fcfs.process("x", {"prompt_token_ids": prompts[0]}, SamplingParams(), priority=1)
    with pytest.raises(ValueError, match="priority has 1 values for 2 prompts"):
        _greedy(llm, prompts[:2], [0])


def test_priority_with_lora_adapters_matches_merged_transformers(tiny_llama, peft_adapters, tokenizer):  # noqa: F811
    llm = _make_llm(tiny_llama, {"scheduling_policy": "priority", "max_loras": 2, "max_cpu_loras": 2,
                                 "max_num_batched_tokens": 16})
    items, loras, expected = _mixed_batch(tiny_llama, peft_adapters, random_prompts([3, 17], len(tokenizer), seed=7))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    priority = [(7 * i) % 3 for i in range(len(items))]
    outputs = llm.generate(items, params, lora_request=loras, use_tqdm=False, priority=priority)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    check_block_accounting(llm)


def test_priority_with_ngram_spec_decode_matches_transformers(tiny_llama, tokenizer):
    llm = float32_llm(tiny_llama, {"scheduling_policy": "priority", "max_num_batched_tokens": 16,
                                   "speculative_config": spec_configs(None, {})["ngram"]})
    stats = record_spec_stats(llm)
    # Long prompts: most tokens the model picks are among theirs, so the proposer drafts.
    prompts = random_prompts([150, 100, 64], len(tokenizer), seed=1)
    assert _greedy(llm, prompts, [2, 0, 1]) == [hf_greedy(tiny_llama, p, MAX_TOKENS) for p in prompts]
    assert stats.num_drafts > 0, stats
    check_block_accounting(llm)
