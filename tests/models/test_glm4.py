"""GLM-4 (norms before and after each block, q/k/v bias, fused gate/up, rope on half of each
head's channels in interleaved pairs): greedy output token-identical to transformers float32
under every scenario of ``tests.models.utils``."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

#: Two prompts past the 16-token windows the suite uses, 6 tokens each: enough to preempt, cheap.
PROMPT_LENGTHS, MAX_TOKENS = (30, 45), 6


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_glm4_greedy_matches_transformers(checkpoint_factory, scenario, tokenizer):
    path = checkpoint_factory("Glm4ForCausalLM", seed=67, attention_bias=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    assert_scenario(path, scenario, prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS)
