"""Granite 4 (Mamba-2 mixers on the state cache, attention on the paged KV cache, Granite's
multipliers, a shared MLP beside routed experts): greedy output token-identical to
transformers float32 with prompts cut into chunks mid-way beside decodes, and with
prefix-cache hits (KV blocks and a saved state); the dense variant without rope
(``num_local_experts`` 0, ``position_embedding_type`` "nope") under chunked prefill, its
logprobs equal to transformers' (``logits_scaling``)."""

from __future__ import annotations

import pytest

from tests.models.utils import assert_logprobs_match, assert_scenario, prompts_for

PROMPT_LENGTHS, MAX_TOKENS = (20, 45, 90), 8
#: A shorter context and fewer sequences: the KV blocks and state slots fit the test cache.
ENGINE = {"max_model_len": 256, "max_num_seqs": 16}
_MIXER = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
              mamba_chunk_size=16, mamba_expand=2)
_GRANITE = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5,
                shared_intermediate_size=96)


@pytest.fixture(scope="module")
def granite4_moe(checkpoint_factory):
    return checkpoint_factory(
        "GraniteMoeHybridForCausalLM", seed=6, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
        position_embedding_type="rope", **_MIXER, **_GRANITE)


@pytest.fixture(scope="module")
def granite4_dense_nope(checkpoint_factory):
    return checkpoint_factory(
        "GraniteMoeHybridForCausalLM", seed=7, num_hidden_layers=4,
        layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0, position_embedding_type="nope",
        **_MIXER, **_GRANITE)


@pytest.mark.parametrize("scenario", ["chunked_prefill", "prefix_caching"])
def test_granite4_moe_greedy_matches_transformers(granite4_moe, scenario, tokenizer):
    assert_scenario(granite4_moe, scenario, prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS, **ENGINE)


def test_granite4_dense_nope_greedy_matches_transformers(granite4_dense_nope, tokenizer):
    prompts = prompts_for(len(tokenizer), PROMPT_LENGTHS)
    llm = assert_scenario(granite4_dense_nope, "chunked_prefill", prompts, MAX_TOKENS, **ENGINE)
    assert_logprobs_match(llm, granite4_dense_nope, prompts[0])  # logits_scaling keeps the argmax
