"""Gemma 3's language model, as ``Gemma3ForCausalLM`` and as the text part of a
``Gemma3ForConditionalGeneration`` checkpoint (``text_config``, ``language_model.`` weights):
greedy output token-identical to transformers float32 under every scenario of
``tests.models.utils``, windows of 16 on the sliding layers (prompts up to 90 tokens), local
and global rope bases apart, and the final soft cap in the logprobs."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_logprobs_match, assert_scenario, prompts_for

GEMMA3_CONFIG = dict(
    num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
)
CHECKPOINTS = {
    "causal_lm": ("Gemma3ForCausalLM", dict(GEMMA3_CONFIG, seed=63, tie_word_embeddings=True,
                                             final_logit_softcapping=4.0)),
    "conditional_generation": ("Gemma3ForConditionalGeneration", dict(GEMMA3_CONFIG, seed=64)),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def gemma3(request, checkpoint_factory):
    arch, kwargs = CHECKPOINTS[request.param]
    return checkpoint_factory(arch, **kwargs)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_gemma3_greedy_matches_transformers(gemma3, scenario, tokenizer):
    prompts = prompts_for(len(tokenizer))
    llm = assert_scenario(gemma3, scenario, prompts, attention_backend="TORCH_SDPA")
    if scenario == "prefix_caching":
        assert_logprobs_match(llm, gemma3, prompts[2])
