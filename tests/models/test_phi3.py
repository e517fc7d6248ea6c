"""Phi-3 (q/k/v and gate/up fused in the checkpoint, ``sliding_window`` on every layer):
greedy output token-identical to transformers float32 under every scenario of
``tests.models.utils``, with windows of 16."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

#: Two prompts past the 16-token windows, 6 tokens each: enough to preempt, cheap.
PROMPT_LENGTHS, MAX_TOKENS = (30, 45), 6


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_phi3_greedy_matches_transformers(checkpoint_factory, scenario, tokenizer):
    path = checkpoint_factory("Phi3ForCausalLM", seed=65, sliding_window=16)
    prompts = prompts_for(len(tokenizer), PROMPT_LENGTHS)
    assert_scenario(path, scenario, prompts, MAX_TOKENS, attention_backend="TORCH_SDPA")
