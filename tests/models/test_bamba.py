"""Bamba (Mamba-2 mixers on the state cache, full-attention layers on the paged KV cache,
the shared Llama blocks): greedy output token-identical to transformers float32 with
prompts cut into chunks mid-way beside decodes, under preemption (too few attention
blocks: a preempted request gives back its blocks and its state slot and recomputes its
state when it resumes), and with prefix-cache hits (KV blocks and a saved state)."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

PROMPT_LENGTHS, MAX_TOKENS = (20, 45, 90), 8


@pytest.fixture(scope="module")
def bamba(checkpoint_factory):
    return checkpoint_factory(
        "BambaForCausalLM", seed=5, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_expand=2,
        attention_bias=True)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_bamba_greedy_matches_transformers(bamba, scenario, tokenizer):
    assert_scenario(bamba, scenario, prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS)
