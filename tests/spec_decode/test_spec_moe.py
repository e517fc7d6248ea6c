"""n-gram speculative decoding with a mixture-of-experts target (Mixtral): the verified
1 + k tokens per request go through the experts, and the greedy output is transformers'."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from tests.helpers import check_block_accounting, float32_llm, hf_greedy, random_prompts
from tests.models.test_mixtral import CONFIG
from tests.spec_decode.test_spec_greedy_equality import record_spec_stats

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def mixtral(checkpoint_factory):
    return checkpoint_factory("MixtralForCausalLM", seed=3, **CONFIG)


def test_ngram_drafts_verified_by_moe_target(mixtral):
    # Prompts that repeat themselves, so the n-gram proposer finds drafts.
    prompts = [p * 3 for p in random_prompts([4, 7, 11], 1000, seed=8)]
    llm = float32_llm(mixtral, {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}})
    stats = record_spec_stats(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(mixtral, p, MAX_TOKENS) for p in prompts]
    assert stats.num_draft_tokens > 0
    check_block_accounting(llm)
