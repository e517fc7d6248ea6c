"""Qwen2-MoE: greedy token-identical to transformers (float32) under chunked prefill,
preemption and prefix caching, with a gated shared expert, un-renormalised top-k
(``norm_topk_prob`` false) and a dense layer among the sparse ones (``mlp_only_layers``)."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

CONFIG = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, intermediate_size=64, norm_topk_prob=False, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def qwen2_moe(checkpoint_factory):
    return checkpoint_factory("Qwen2MoeForCausalLM", seed=5, **CONFIG)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_transformers(qwen2_moe, scenario):
    assert_scenario(qwen2_moe, scenario, prompts_for(1024))
