"""OLMo 2 (q/k RMSNorm over the whole projections, post-block norms only): greedy output
token-identical to transformers float32 under every scenario of ``tests.models.utils``, and
with two tensor-parallel ranks."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import can_host_workers, check_block_accounting
from tests.models.utils import SCENARIOS, assert_logprobs_match, assert_scenario, prompts_for, transformers_greedy

#: Two prompts past the 16-token windows the suite uses, 6 tokens each: enough to preempt, cheap.
PROMPT_LENGTHS, MAX_TOKENS = (30, 45), 6


@pytest.fixture(scope="module")
def olmo2(checkpoint_factory):
    return checkpoint_factory("Olmo2ForCausalLM", seed=61, attention_bias=True)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_olmo2_greedy_matches_transformers(olmo2, scenario, tokenizer):
    assert_scenario(olmo2, scenario, prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS)


@pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")
def test_olmo2_tensor_parallel_matches_transformers(olmo2, tokenizer):
    """Two ranks, each norming its q/k heads by the mean square over both."""
    prompts = prompts_for(len(tokenizer), PROMPT_LENGTHS)
    llm = LLM(str(olmo2), dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == transformers_greedy(olmo2, prompts, MAX_TOKENS)
        check_block_accounting(llm)
        assert_logprobs_match(llm, olmo2, prompts[1])  # a mean square off by a few % keeps the argmax
    finally:
        llm.llm_engine.engine_core.shutdown()
