"""Qwen2-MoE: greedy token-identical to transformers (float32) under chunked prefill,
preemption and prefix caching, with a gated shared expert, un-renormalised top-k
(``norm_topk_prob`` false) and a dense layer among the sparse ones (``mlp_only_layers``); the
config's ``qkv_bias`` is honoured."""

from __future__ import annotations

import pytest
from transformers import Qwen2MoeConfig

from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.selector import set_attn_backend
from pagedllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

CONFIG = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, intermediate_size=64, norm_topk_prob=False, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def qwen2_moe(checkpoint_factory):
    return checkpoint_factory("Qwen2MoeForCausalLM", seed=5, **CONFIG)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_transformers(qwen2_moe, scenario):
    assert_scenario(qwen2_moe, scenario, prompts_for(1024))


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_qkv_bias_follows_the_config(qkv_bias):
    config = Qwen2MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                            vocab_size=256, num_experts=4, moe_intermediate_size=32, qkv_bias=qkv_bias)
    with set_attn_backend(TorchSDPABackend):
        model = Qwen2MoeForCausalLM(config)
    attention = model.model.layers[0].self_attn
    assert (attention.qkv_proj.bias is not None) == qkv_bias and attention.o_proj.bias is None
