"""OLMo 2 (q/k RMSNorm over the whole projections, post-block norms only): greedy output
token-identical to transformers float32 under every scenario of ``tests.models.utils``."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

#: Two prompts past the 16-token windows the suite uses, 6 tokens each: enough to preempt, cheap.
PROMPT_LENGTHS, MAX_TOKENS = (30, 45), 6


@pytest.fixture(scope="module")
def olmo2(checkpoint_factory):
    return checkpoint_factory("Olmo2ForCausalLM", seed=61, attention_bias=True)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_olmo2_greedy_matches_transformers(olmo2, scenario, tokenizer):
    assert_scenario(olmo2, scenario, prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS)
