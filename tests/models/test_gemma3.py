"""Gemma 3's language model, as ``Gemma3ForCausalLM`` and inside a
``Gemma3ForConditionalGeneration`` checkpoint on text-only prompts (``text_config``,
``language_model.`` weights, a tiny vision tower loaded beside; images:
``tests/models/test_gemma3_mm.py``): greedy output token-identical to transformers float32
(every scenario of ``tests.models.utils`` for the first, chunked prefill for the second, whose
language model is the same), windows of 16 on the sliding layers, local and global rope bases apart, and the final
soft cap (which keeps the argmax) in the logprobs."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_logprobs_match, assert_scenario, prompts_for

#: Two prompts past the 16-token windows, 6 tokens each: enough to preempt, cheap.
PROMPT_LENGTHS, MAX_TOKENS = (30, 45), 6
GEMMA3_CONFIG = dict(
    num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_gemma3_greedy_matches_transformers(checkpoint_factory, scenario, tokenizer):
    path = checkpoint_factory("Gemma3ForCausalLM", **GEMMA3_CONFIG, seed=63, tie_word_embeddings=True,
                              final_logit_softcapping=4.0)
    prompts = prompts_for(len(tokenizer), PROMPT_LENGTHS)
    llm = assert_scenario(path, scenario, prompts, MAX_TOKENS)
    if scenario == "prefix_caching":
        assert_logprobs_match(llm, path, prompts[1])


def test_gemma3_image_text_checkpoint_serves_its_language_model(checkpoint_factory, tokenizer):
    path = checkpoint_factory("Gemma3ForConditionalGeneration", **GEMMA3_CONFIG, seed=64)
    prompts = prompts_for(len(tokenizer), PROMPT_LENGTHS)
    llm = assert_scenario(path, "chunked_prefill", prompts, MAX_TOKENS)
    assert_logprobs_match(llm, path, prompts[1])
