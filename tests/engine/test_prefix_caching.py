"""Automatic prefix caching end to end: cached KV gives the same tokens as recomputed KV."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import check_block_accounting, kv_block_bytes, random_prompts


def _workload(vocab_size: int) -> list[list[int]]:
    system_a, system_b = random_prompts([70, 45], vocab_size, seed=11)
    questions = random_prompts([5, 12, 30, 8, 17, 3], vocab_size, seed=12)
    shared = [system_a + q for q in questions[:3]] + [system_b + q for q in questions[3:]]
    turn1 = random_prompts([40], vocab_size, seed=13)[0]
    turns = [turn1, turn1 + questions[0], turn1 + questions[0] + questions[1]]
    exact = random_prompts([64], vocab_size, seed=14)[0]
    return shared + turns + [exact[:32], exact, exact]


SCENARIOS = {
    "defaults": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"max_model_len": 256, "block_size": 8, "kv_blocks": 34},
    # The same on an FP8 cache: cached, chunked and recomputed blocks hold the same bytes.
    "fp8_kv_cache": {"kv_cache_dtype": "fp8"},
    "fp8_chunked_prefill": {"kv_cache_dtype": "fp8", "max_num_batched_tokens": 16},
    "fp8_preemption": {"kv_cache_dtype": "fp8_e5m2", "max_model_len": 256, "block_size": 8, "kv_blocks": 34},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_identical_with_and_without_caching(tiny_qwen2, tokenizer, scenario):
    prompts = [{"prompt_token_ids": p} for p in _workload(len(tokenizer))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = {}
    for caching in (False, True):
        kwargs = dict(SCENARIOS[scenario])
        kv_blocks = kwargs.pop("kv_blocks", None)
        kwargs["kv_cache_memory_bytes"] = 16 << 20
        if kv_blocks:
            probe = LLM(str(tiny_qwen2), dtype="float32", **kwargs)
            kwargs["kv_cache_memory_bytes"] = kv_blocks * kv_block_bytes(probe)
            del probe
        llm = LLM(str(tiny_qwen2), dtype="float32", enable_prefix_caching=caching, **kwargs)
        # Two passes: the second runs fully warm, the first mixes cold and warm requests.
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
        results[caching] = (first, second)
        if "preemption" in scenario:
            assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        check_block_accounting(llm)
    cold = [o.outputs[0].token_ids for o in results[False][0]]
    for outputs in (results[False][1], *results[True]):
        assert [o.outputs[0].token_ids for o in outputs] == cold
    assert all(o.num_cached_tokens == 0 for o in results[False][0] + results[False][1])
    assert sum(o.num_cached_tokens for o in results[True][1]) > 0


def test_exact_cached_token_counts(tiny_llama, tokenizer):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prefix = random_prompts([100], len(tokenizer), seed=21)[0]
    a, b = random_prompts([9, 14], len(tokenizer), seed=22)
    assert llm.generate({"prompt_token_ids": prefix + a}, params, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate({"prompt_token_ids": prefix + b}, params, use_tqdm=False)[0].num_cached_tokens == 96
    exact = random_prompts([64], len(tokenizer), seed=23)[0]
    assert llm.generate({"prompt_token_ids": exact}, params, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate({"prompt_token_ids": exact}, params, use_tqdm=False)[0].num_cached_tokens == 48
    check_block_accounting(llm)


def test_cache_salt(tiny_llama, tokenizer):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = random_prompts([50], len(tokenizer), seed=31)[0]

    def cached(salt):
        prompt = {"prompt_token_ids": tokens} if salt is None else {"prompt_token_ids": tokens, "cache_salt": salt}
        return llm.generate(prompt, params, use_tqdm=False)[0]

    first = cached("alice")
    assert first.num_cached_tokens == 0
    assert cached("bob").num_cached_tokens == 0
    assert cached(None).num_cached_tokens == 0
    again = cached("alice")
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_every_hash_algorithm_gives_a_working_cache(tiny_llama, tokenizer, algo):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=16 << 20, prefix_caching_hash_algo=algo)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": random_prompts([40], len(tokenizer), seed=41)[0]}
    cold = llm.generate(prompt, params, use_tqdm=False)[0]
    warm = llm.generate(prompt, params, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 32 and warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_unknown_hash_algorithm_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match="Unknown prefix_caching_hash_algo 'md5'"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=1 << 20, prefix_caching_hash_algo="md5")


def test_reset_prefix_cache(tiny_llama, tokenizer):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = {"prompt_token_ids": random_prompts([40], len(tokenizer), seed=51)[0]}
    llm.generate(prompt, params, use_tqdm=False)
    llm.reset_prefix_cache()
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    engine = llm.llm_engine
    engine.add_request("busy", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    with pytest.raises(RuntimeError, match="while requests are running"):
        llm.reset_prefix_cache()
    engine.abort_request("busy")
    llm.reset_prefix_cache()


def test_prompt_logprobs_requests_bypass_the_cache(tiny_llama, tokenizer):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=16 << 20)
    prompt = {"prompt_token_ids": random_prompts([40], len(tokenizer), seed=61)[0]}
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 40
