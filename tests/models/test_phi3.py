"""Phi-3 (q/k/v and gate/up fused in the checkpoint, ``sliding_window`` on every layer) and
Phi-4-mini's partial rotary under longrope: greedy output token-identical to transformers
float32 under every scenario of ``tests.models.utils``, with windows of 16."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_logprobs_match, assert_scenario, prompts_for

#: Two prompts past the 16-token windows, 6 tokens each: enough to preempt, cheap.
PROMPT_LENGTHS, MAX_TOKENS = (30, 45), 6
#: Longrope on 3/4 of each 16-channel head (6 factors each), an original length of 64 (the
#: prompts stay below it: the short factors, and longrope's attention factor, apply).
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.1], "long_factor": [1.2, 1.9, 3.3, 5.0, 8.0, 12.0]}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_phi3_greedy_matches_transformers(checkpoint_factory, scenario, tokenizer):
    path = checkpoint_factory("Phi3ForCausalLM", seed=65, sliding_window=16)
    assert_scenario(path, scenario, prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS)


def test_phi4_mini_partial_longrope_matches_transformers(checkpoint_factory, tokenizer):
    path = checkpoint_factory("Phi3ForCausalLM", seed=68, rope_parameters=LONGROPE, original_max_position_embeddings=64,
                              max_position_embeddings=256)
    prompts = prompts_for(len(tokenizer), PROMPT_LENGTHS)
    llm = assert_scenario(path, "chunked_prefill", prompts, MAX_TOKENS)
    assert_logprobs_match(llm, path, prompts[1])
