"""Qwen3-MoE: greedy token-identical to transformers (float32) under chunked prefill,
preemption and prefix caching, with q/k norms, renormalised top-k (``norm_topk_prob``) and
experts on every second layer only (``decoder_sparse_step`` 2), the experts on the fused C++
kernel where it is built; int8 experts."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.quantization.grouped import INT8_ACTIVATIONS_ENV
from tests.helpers import assert_greedy_equals_hf, check_block_accounting, model_runner, rewrite_linear_weights
from tests.model_executor.test_int8 import _int8_round_trip
from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

CONFIG = dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=2)


@pytest.fixture(scope="module")
def qwen3_moe(checkpoint_factory):
    return checkpoint_factory("Qwen3MoeForCausalLM", seed=6, **CONFIG)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_transformers(qwen3_moe, scenario):
    assert_scenario(qwen3_moe, scenario, prompts_for(1024))


def test_experts_on_the_fused_kernel_equal_transformers(qwen3_moe):
    """With the C++ kernels, every expert layer is packed for the fused kernel (one call per
    layer and step) and greedy output stays token-identical."""
    llm = LLM(str(qwen3_moe), dtype="float32", kv_cache_memory_bytes=8 << 20)
    experts = [m for m in model_runner(llm).model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(hasattr(m, "w13_packed") == cpu_kernels.is_available() for m in experts)
    assert_greedy_equals_hf(llm, qwen3_moe)
    check_block_accounting(llm)


def test_int8_experts_equal_transformers_on_dequantized_weights(qwen3_moe, tmp_path, monkeypatch):
    """``--quantization int8`` quantizes the experts too (per output channel, the router kept):
    greedy output equals transformers' with every linear and expert weight dequantized."""
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")  # transformers multiplies float activations
    dequantized = rewrite_linear_weights(qwen3_moe, tmp_path / "dequantized", _int8_round_trip)
    llm = LLM(str(qwen3_moe), dtype="float32", quantization="int8", kv_cache_memory_bytes=8 << 20)
    experts = [m for m in model_runner(llm).model.modules() if isinstance(m, FusedMoE)]
    if cpu_kernels.is_available():  # the fused kernel's int8 blocks, one scale per W13 row of each expert
        assert experts and all(m.w13_scale.shape == (8, 64) for m in experts)
    else:
        assert experts and all(m.w13_experts[0].weight_scale.shape == (64,) for m in experts)
    assert not any(hasattr(m, "w13_weight") for m in experts)
    assert_greedy_equals_hf(llm, dequantized)
    check_block_accounting(llm)
