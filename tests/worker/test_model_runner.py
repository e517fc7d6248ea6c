"""The KV cache is never cleared: blocks handed to a request, and the block tables' padding,
may hold anything a block held before (here NaN). The CPU kernel reads no slot past a
request's context, and the portable attention zeroes the values it gathered there, so the
greedy output equals a clean cache's either way (the backend chosen automatically: CPU_ATTN
with the kernels, TORCH_SDPA without).

The runner also samples several positions of a request in one step (``logits_indices``), as
speculative decoding does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.platforms import current_platform
from tests.helpers import model_runner, random_prompts


@pytest.mark.parametrize("kernels", [True, False])
def test_stale_nan_in_fresh_blocks_never_reaches_outputs(kernels, tiny_qwen2, tokenizer, disable_cpu_kernels):
    if not kernels:
        disable_cpu_kernels()
    prompts = random_prompts([5, 21, 40], len(tokenizer), seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(tiny_qwen2), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=16)
    runner = model_runner(llm)
    assert runner.attn_backend.get_name() == ("CPU_ATTN" if kernels and current_platform.is_cpu else "TORCH_SDPA")
    clean = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm.llm_engine.reset_prefix_cache()
    for cache in runner.kv_caches:
        cache.fill_(float("nan"))
    again = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert again == clean
    assert bool(runner.kv_caches[0].isnan().any())  # nothing cleared the unused slots


def _sample_last_positions(original, k):
    """A ``_logits_indices`` that samples the last ``k`` scheduled positions of every
    request that samples (as a speculative-decoding step verifying k - 1 drafts)."""

    def logits_indices(rows, seq_lens, cu, num_drafts):
        indices, reqs = original(rows, seq_lens, cu, num_drafts)
        starts = cu - np.diff(cu, prepend=0)
        many = [(i - n + 1 + m, r) for i, r in zip(indices.tolist(), reqs.tolist())
                for n in [min(k, int(cu[r] - starts[r]))] for m in range(n)]
        return np.array([i for i, _ in many], dtype=np.int64), np.array([r for _, r in many], dtype=np.int64)

    return logits_indices


def test_several_logits_indices_per_request_sample_each_position(tiny_qwen2, tokenizer, monkeypatch):
    """Prompt + its first 3 greedy tokens, sampled at the last 4 positions in one step, gives
    the 4 greedy tokens (each position predicts the next), for every request of the batch."""
    prompts = random_prompts([9, 13], len(tokenizer), seed=3)
    llm = LLM(str(tiny_qwen2), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    sequential = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    greedy = [o.outputs[0].token_ids for o in sequential]

    runner = model_runner(llm)
    monkeypatch.setattr(runner, "_logits_indices", _sample_last_positions(runner._logits_indices, 4))
    extended = [{"prompt_token_ids": p + g[:3]} for p, g in zip(prompts, greedy)]
    at_once = llm.generate(extended, params, use_tqdm=False)
    for seq, one_step, tokens in zip(sequential, at_once, greedy):
        out = one_step.outputs[0]
        assert out.token_ids == tokens and out.finish_reason == "length"
        assert len(out.logprobs) == 4
        for want, got, token in zip(seq.outputs[0].logprobs, out.logprobs, tokens):
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)

    # max_tokens 2: the first two tokens are kept, the other two dropped.
    short = llm.generate(extended, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in short] == [g[:2] for g in greedy]


def test_every_step_runs_in_inference_mode(tiny_qwen2, tokenizer):
    """The model's forward (and the sampler after it) runs under ``torch.inference_mode``:
    no autograd graph is kept for a step's activations, and a tensor-parallel all-reduce
    (whose ``out=`` ops refuse tensors that require grad) sees none."""
    seen = []
    llm = LLM(str(tiny_qwen2), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=16)
    runner = model_runner(llm)
    hook = runner.model.register_forward_hook(
        lambda module, args, out: seen.append((torch.is_inference_mode_enabled(), out.requires_grad)))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in random_prompts([6, 11], len(tokenizer), seed=2)], params,
                     use_tqdm=False)
    finally:
        hook.remove()
    assert seen and all(inference and not grad for inference, grad in seen)
