"""``--quantization int8`` experts on the fused C++ kernel (``fused_moe_w8``): on CPU with the
kernels, every expert layer of a Mixtral and a Qwen3-MoE checkpoint holds int8 blocks and
per-channel scales (no per-expert plans), the start-up log names the path, and greedy output
under chunked prefill equals transformers' on the checkpoint with every linear and expert
weight replaced by its dequantized value (scale * Q); the block accounting holds after."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.quantization.grouped import INT8_ACTIVATIONS_ENV
from tests.helpers import (LINEAR_SUFFIXES, MIXTRAL_EXPERT_SUFFIXES, assert_greedy_equals_hf, check_block_accounting,
                           model_runner, rewrite_linear_weights)
from tests.model_executor.test_int8 import _int8_round_trip
from tests.model_executor.test_moe_quantization import MODELS


@pytest.mark.parametrize("model", sorted(MODELS))
def test_int8_experts_on_the_fused_kernel_equal_transformers(kernel, checkpoint_factory, tmp_path, monkeypatch, model):
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")  # the dense layers multiply float activations too
    arch, config = MODELS[model]
    checkpoint = checkpoint_factory(arch, seed=11, **config)
    reference = rewrite_linear_weights(checkpoint, tmp_path / "dequantized", _int8_round_trip,
                                       LINEAR_SUFFIXES + MIXTRAL_EXPERT_SUFFIXES)
    llm = LLM(str(checkpoint), dtype="float32", quantization="int8", kv_cache_memory_bytes=8 << 20,
              block_size=8, max_num_batched_tokens=16, enable_chunked_prefill=True)
    experts = [m for m in model_runner(llm).model.modules() if isinstance(m, FusedMoE)]
    assert experts
    for layer in experts:
        assert not hasattr(layer, "w13_experts") and not hasattr(layer, "w13_weight")
        hidden = layer.w13_packed.shape[2]  # 8 experts, I = 32: W13 [64, H], W2 [H, 32]
        assert layer.w13_packed.dtype == torch.int8 and layer.w13_packed.shape == (8, 4, hidden, 16)
        assert layer.w2_packed.dtype == torch.int8 and layer.w2_packed.shape == (8, (hidden + 15) // 16, 32, 16)
        assert layer.w13_scale.shape == (8, 64) and layer.w2_scale.shape == (8, hidden)
        assert layer.quant_method.describe_path(layer).startswith(
            "experts: fused C++ kernel (int8 weight-only blocks, per-channel scales")
    assert_greedy_equals_hf(llm, reference)
    check_block_accounting(llm)
