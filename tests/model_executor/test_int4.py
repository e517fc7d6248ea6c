"""``--quantization int4``: weight-only 4-bit, symmetric, groups of 128 inputs (Q4_0's
arithmetic), applied at load. The engine's greedy output equals transformers' on the same
checkpoint with every linear weight replaced by its dequantized values, the lm_head stays in
the model dtype; a layer whose inputs are not whole groups of 128 gets groups of 32, and one
whose inputs are not whole groups of 32 either fails at load, named."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.model_executor.layers.quantization.int4 import INT4_GROUP_SIZE, int4_group_size, quantize_int4_per_group
from tests.helpers import assert_greedy_equals_hf, model_runner, rewrite_linear_weights


def _int4_round_trip(weight: torch.Tensor) -> torch.Tensor:
    q, scale, zero = quantize_int4_per_group(weight, INT4_GROUP_SIZE)
    group = INT4_GROUP_SIZE
    return scale.repeat_interleave(group, 1) * (q.float() - zero.repeat_interleave(group, 1))


def test_quantize_per_group_round_trip():
    torch.manual_seed(0)
    w = torch.randn(6, 64)
    w[2, :32] = 0
    q, scale, zero = quantize_int4_per_group(w, 32)
    assert q.dtype == torch.uint8 and scale.shape == zero.shape == (6, 2) and bool((zero == 8).all())
    assert int(q.max()) <= 15 and scale[2, 0] == 1 and bool((q[2, :32] == 8).all())
    # The extreme weight of each group is represented exactly (it maps onto level 0 = -8).
    extreme = w.view(6, 2, 32).abs().amax(dim=2)
    deq = scale.repeat_interleave(32, 1) * (q.float() - 8)
    assert torch.allclose(deq.view(6, 2, 32).abs().amax(dim=2), extreme)
    # Rounding error: half a step, or one step where +8 steps is clamped to level 15 (as Q4_0).
    step = scale.abs().repeat_interleave(32, 1)
    err = (deq - w).abs()
    assert bool((err <= step + 1e-6).all()) and bool((err[q < 15] <= step[q < 15] / 2 + 1e-6).all())
    with pytest.raises(ValueError, match="not a whole number of int4 groups of 32"):
        quantize_int4_per_group(torch.randn(2, 48), 32)


def test_int4_greedy_equals_hf_on_dequantized_weights(llama_128, tmp_path):
    reference = rewrite_linear_weights(llama_128, tmp_path / "int4-dequantized", _int4_round_trip)
    llm = LLM(str(llama_128), dtype="float32", quantization="int4", kv_cache_memory_bytes=8 << 20)
    assert_greedy_equals_hf(llm, reference)
    model = model_runner(llm).model
    quantized = [m for m in model.modules() if hasattr(m, "weight_zero_point")]
    assert len(quantized) == 4 * model_runner(llm).model_config.num_layers  # qkv, o, gate_up, down
    assert all(m.weight.dtype == torch.uint8 for m in quantized)
    assert model.lm_head.weight.dtype == torch.float32


def test_inputs_not_whole_groups_of_128_use_groups_of_32(tiny_llama):
    llm = LLM(str(tiny_llama), quantization="int4", kv_cache_memory_bytes=8 << 20)  # hidden size 64
    quantized = [m for m in model_runner(llm).model.modules() if hasattr(m, "weight_zero_point")]
    groups = {m.input_size_per_partition: m.input_size_per_partition // m.weight_scale.shape[1] for m in quantized}
    assert groups[64] == 32 and all(g == (128 if k % 128 == 0 else 32) for k, g in groups.items())
    assert int4_group_size(256, "x") == 128 and int4_group_size(704, "x") == 32


def test_inputs_not_whole_groups_of_32_fail_naming_the_layer():
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.mlp\.down_proj has 48 inputs, not a multiple"):
        int4_group_size(48, "model.layers.0.mlp.down_proj")
