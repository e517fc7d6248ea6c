"""Sampled requests under speculative decoding: the matching rule draws each position from
the target's own sampler, seeded per output position, so a seeded request yields the same
tokens (and logprobs) with and without speculation, penalties, top-k / top-p, min_tokens,
stop strings and n > 1 included."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import check_block_accounting, random_prompts
from tests.spec_decode.test_spec_greedy_equality import record_spec_stats

PARAMS = {
    "seeded": dict(temperature=0.8, seed=7),
    "penalties_top_k_p": dict(temperature=1.0, top_k=20, top_p=0.9, seed=3, repetition_penalty=1.3,
                              presence_penalty=0.5, frequency_penalty=0.3),
    "min_tokens_logprobs": dict(temperature=0.7, seed=5, min_tokens=10, logprobs=3),
    "n_2": dict(temperature=0.9, seed=11, n=2),
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.5, logprobs=2),
}


@pytest.mark.parametrize("case", list(PARAMS))
def test_seeded_sampling_is_unchanged_by_speculation(case, tiny_llama, noisy_llama_draft, tokenizer):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([4, 30, 70], len(tokenizer), seed=9)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, **PARAMS[case])
    plain = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=8 << 20)
    expected = plain.generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=32,
              speculative_config={"model": str(noisy_llama_draft), "num_speculative_tokens": 3, "enable_adaptive_k": False})
    stats = record_spec_stats(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    for want, out in zip(expected, got):
        assert len(out.outputs) == len(want.outputs)
        for w, o in zip(want.outputs, out.outputs):
            assert o.token_ids == w.token_ids
            if params.logprobs is not None:
                assert len(o.logprobs) == len(o.token_ids)
                for lw, lo, token in zip(w.logprobs, o.logprobs, o.token_ids):
                    assert lo[token].logprob == pytest.approx(lw[token].logprob, abs=1e-4)
                    assert lo[token].rank == lw[token].rank
    assert stats.num_accepted_tokens > 0, stats
    check_block_accounting(llm)


def test_stop_string_and_stop_token_inside_accepted_drafts(tiny_llama, tokenizer):
    """A draft equal to the target accepts k tokens per step; a stop token id in the middle of
    them ends the request there, as without speculation (the rest are dropped)."""
    prompt = random_prompts([25], len(tokenizer), seed=2)[0]
    plain = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=8 << 20)
    greedy = plain.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    stop_id = greedy[6]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    want = plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 4, "enable_adaptive_k": False})
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids == greedy[: greedy.index(stop_id) + 1]
    assert got.finish_reason == "stop" and got.stop_reason == stop_id
    check_block_accounting(llm)


def test_sampled_drafts_of_a_copy_are_all_accepted(tiny_llama, tokenizer):
    """Unseeded sampled requests: a draft model samples its drafts from q and the rejection
    sampler accepts with min(1, p / q); a draft equal to the target has q = p, so (up to
    rounding) every draft is accepted, at any temperature."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 50], len(tokenizer), seed=12)]
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 4, "enable_adaptive_k": False})
    stats = record_spec_stats(llm)
    outputs = llm.generate(prompts, SamplingParams(temperature=1.3, max_tokens=21, ignore_eos=True, logprobs=1),
                           use_tqdm=False)
    assert stats.num_draft_tokens == 2 * 4 * 4
    assert stats.num_accepted_tokens >= stats.num_draft_tokens - 1, stats
    for out in outputs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 21 and len(completion.logprobs) == 21
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry  # the logprob of the token kept, not of another sample
    check_block_accounting(llm)


def test_sampled_drafts_of_another_model_are_verified(tiny_llama, noisy_llama_draft, tokenizer):
    """A draft that differs from the target: sampled drafts are partly accepted, partly
    rejected (and replaced by samples from norm(max(0, p - q))); the output is valid."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 50, 90], len(tokenizer), seed=13)]
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=40,
              speculative_config={"model": str(noisy_llama_draft), "num_speculative_tokens": 3, "enable_adaptive_k": False})
    stats = record_spec_stats(llm)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, ignore_eos=True, presence_penalty=0.5, n=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert all(len(c.token_ids) == 24 for out in outputs for c in out.outputs)
    check_block_accounting(llm)
