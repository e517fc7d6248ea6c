"""Gemma 2 (Gemma's blocks with alternating sliding windows, one rope, soft caps on the
attention scores and the logits): greedy output token-identical to transformers float32
under every scenario of ``tests.models.utils``, windows of 16, and the final soft cap (which
keeps the argmax) in the logprobs."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_logprobs_match, assert_scenario, prompts_for

#: Two prompts past the 16-token windows, 6 tokens each: enough to preempt, cheap.
PROMPT_LENGTHS, MAX_TOKENS = (30, 45), 6
GEMMA2_CONFIG = dict(num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                     attn_logit_softcapping=2.0, final_logit_softcapping=4.0, tie_word_embeddings=True)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_gemma2_greedy_matches_transformers(checkpoint_factory, scenario, tokenizer):
    path = checkpoint_factory("Gemma2ForCausalLM", **GEMMA2_CONFIG, seed=66)
    prompts = prompts_for(len(tokenizer), PROMPT_LENGTHS)
    llm = assert_scenario(path, scenario, prompts, MAX_TOKENS)
    if scenario == "prefix_caching":
        assert_logprobs_match(llm, path, prompts[1])
