"""Qwen3-MoE: greedy token-identical to transformers (float32) under chunked prefill,
preemption and prefix caching, with q/k norms, renormalised top-k (``norm_topk_prob``) and
experts on every second layer only (``decoder_sparse_step`` 2)."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

CONFIG = dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=2)


@pytest.fixture(scope="module")
def qwen3_moe(checkpoint_factory):
    return checkpoint_factory("Qwen3MoeForCausalLM", seed=6, **CONFIG)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_transformers(qwen3_moe, scenario):
    assert_scenario(qwen3_moe, scenario, prompts_for(1024))
