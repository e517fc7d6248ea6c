"""Granite (embedding / residual / attention multipliers, logits scaling): greedy output
token-identical to transformers float32 under every scenario of ``tests.models.utils``."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_logprobs_match, assert_scenario, prompts_for

#: Two prompts past the 16-token windows the suite uses, 6 tokens each: enough to preempt, cheap.
PROMPT_LENGTHS, MAX_TOKENS = (30, 45), 6


@pytest.fixture(scope="module")
def granite(checkpoint_factory):
    # Factors far from 1 (and a scale far from head_dim ** -0.5 = 0.25), so each one shows.
    return checkpoint_factory("GraniteForCausalLM", seed=62, embedding_multiplier=0.5, residual_multiplier=0.4,
                              attention_multiplier=0.6, logits_scaling=2.5)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_granite_greedy_matches_transformers(granite, scenario, tokenizer):
    prompts = prompts_for(len(tokenizer), PROMPT_LENGTHS)
    llm = assert_scenario(granite, scenario, prompts, MAX_TOKENS)
    if scenario == "prefix_caching":  # logits_scaling keeps the argmax: the logprobs show it
        assert_logprobs_match(llm, granite, prompts[1])
