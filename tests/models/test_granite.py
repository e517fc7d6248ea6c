"""Granite (embedding / residual / attention multipliers, logits scaling): greedy output
token-identical to transformers float32 under every scenario of ``tests.models.utils``."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_scenario, prompts_for


@pytest.fixture(scope="module")
def granite(checkpoint_factory):
    # Factors far from 1 (and a scale far from head_dim ** -0.5 = 0.25), so each one shows.
    return checkpoint_factory("GraniteForCausalLM", seed=62, embedding_multiplier=0.5, residual_multiplier=0.4,
                              attention_multiplier=0.6, logits_scaling=2.5)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_granite_greedy_matches_transformers(granite, scenario, tokenizer):
    assert_scenario(granite, scenario, prompts_for(len(tokenizer)))
