"""DeepSeek-V2 / V3 (multi-head latent attention, DeepSeekMoE): greedy token-identical to
transformers (float32) under chunked prefill, preemption and prefix caching. V2: a plain
q_proj (``q_lora_rank`` None), interleaved rope, softmax router with group_limited_greedy;
V3: the q LoRA path, sigmoid router with a non-zero ``e_score_correction_bias``, renormalised
and scaled weights, YaRN rope with ``mscale_all_dim`` (the softmax-scale correction). Both
have a dense first layer and a shared expert. The KV cache holds one latent of
``kv_lora_rank + qk_rope_head_dim`` values per token and layer."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import check_block_accounting, float32_llm, model_runner
from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

MLA = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, kv_lora_rank=32,
           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1)
V2 = dict(MLA, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=2.0)
V3 = dict(MLA, q_lora_rank=32, routed_scaling_factor=2.5, norm_topk_prob=True,
          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                        "mscale": 1.0, "mscale_all_dim": 1.0})
#: Values per token and layer in the latent cache: kv_lora_rank + qk_rope_head_dim.
LATENT = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]


def _random_score_bias(path) -> None:
    """Give the checkpoint's ``e_score_correction_bias`` random values (transformers writes
    zeros), so the routing test sees the bias move the choice."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.randn(tensor.shape, generator=gen) * 0.3
    assert any(name.endswith("e_score_correction_bias") for name in tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def deepseek_v2(checkpoint_factory):
    return checkpoint_factory("DeepseekV2ForCausalLM", seed=11, **V2)


@pytest.fixture(scope="module")
def deepseek_v3(checkpoint_factory):
    path = checkpoint_factory("DeepseekV3ForCausalLM", seed=12, **V3)
    _random_score_bias(path)
    return path


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_v2_greedy_equals_transformers(deepseek_v2, scenario):
    assert_scenario(deepseek_v2, scenario, prompts_for(1024))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_v3_greedy_equals_transformers(deepseek_v3, scenario):
    assert_scenario(deepseek_v3, scenario, prompts_for(1024))


def test_cache_holds_one_latent_per_token_and_layer(deepseek_v2):
    """kv_lora_rank + qk_rope_head_dim values per token and layer: the same budget holds
    (H x (qk_nope + qk_rope + v_head_dim)) / LATENT = 4 x the tokens of full keys and values."""
    budget, block_size, num_layers = 1 << 20, 8, MLA["num_hidden_layers"]
    llm = float32_llm(deepseek_v2, {"block_size": block_size, "kv_cache_memory_bytes": budget})
    runner = model_runner(llm)
    latent_bytes = num_layers * LATENT * 4  # float32, per token
    assert runner.kv_cache_bytes_per_token() == latent_bytes
    num_blocks = budget // (latent_bytes * block_size)
    assert [tuple(c.shape) for c in runner.kv_caches] == [(num_blocks, block_size, LATENT)] * num_layers
    full_kv_values = MLA["num_attention_heads"] * (MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"] + MLA["v_head_dim"])
    full_kv_tokens = budget // (num_layers * full_kv_values * 4)
    assert num_blocks * block_size >= 4 * (full_kv_tokens // block_size * block_size)
    check_block_accounting(llm)
