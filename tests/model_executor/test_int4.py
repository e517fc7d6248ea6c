"""``--quantization int4``: weight-only 4-bit, symmetric, groups of 32 inputs by default
(llama.cpp Q4_0's arithmetic and group), applied at load. The engine's greedy output equals
transformers' on the same checkpoint with every linear weight replaced by its dequantized values,
the lm_head stays in the model dtype. ``quantization_config={"group_size": 128}`` (vLLM's
``--quantization-config``) chooses groups of 128, and a layer whose inputs are not whole groups
of 128 then gets groups of 32; a layer whose inputs are not whole groups of 32 fails at load,
named, as do group sizes and keys the format does not support. The start-up log names each
layer's group size."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import LLM
from pagedllm.model_executor.layers.quantization.grouped import INT8_ACTIVATIONS_ENV
from pagedllm.model_executor.layers.quantization.int4 import INT4_GROUP_SIZE, int4_group_size, quantize_int4_per_group
from tests.helpers import assert_greedy_equals_hf, model_runner, rewrite_linear_weights


def _int4_round_trip(weight: torch.Tensor, group: int = INT4_GROUP_SIZE) -> torch.Tensor:
    q, scale, zero = quantize_int4_per_group(weight, group)
    return scale.repeat_interleave(group, 1) * (q.float() - zero.repeat_interleave(group, 1))


def _groups(llm: LLM) -> dict[int, set[int]]:
    """Inputs of each quantized layer -> the group sizes of the layers with that many."""
    groups: dict[int, set[int]] = {}
    for m in model_runner(llm).model.modules():
        if hasattr(m, "weight_zero_point"):
            k = m.input_size_per_partition
            groups.setdefault(k, set()).add(k // m.weight_scale.shape[1])
    return groups


def test_quantize_per_group_round_trip():
    torch.manual_seed(0)
    w = torch.randn(6, 64)
    w[2, :32] = 0
    q, scale, zero = quantize_int4_per_group(w, 32)
    assert q.dtype == torch.uint8 and scale.shape == zero.shape == (6, 2) and bool((zero == 8).all())
    assert int(q.max()) <= 15 and scale[2, 0] == 1 and bool((q[2, :32] == 8).all())
    # Scales are float16 values (Q4_0's); the extreme weight of each group maps onto level 0 =
    # -8, exactly up to that rounding.
    assert torch.equal(scale.half().float(), scale)
    extreme = w.view(6, 2, 32).abs().amax(dim=2)
    deq = scale.repeat_interleave(32, 1) * (q.float() - 8)
    assert torch.allclose(deq.view(6, 2, 32).abs().amax(dim=2), extreme, rtol=2.0**-11, atol=0)
    # Rounding error: half a step, or one step where +8 steps is clamped to level 15 (as Q4_0).
    step = scale.abs().repeat_interleave(32, 1)
    err = (deq - w).abs()
    assert bool((err <= step + 1e-6).all()) and bool((err[q < 15] <= step[q < 15] / 2 + 1e-6).all())
    with pytest.raises(ValueError, match="not a whole number of int4 groups of 32"):
        quantize_int4_per_group(torch.randn(2, 48), 32)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_greedy_equals_hf_on_dequantized_weights(llama_128, tmp_path, group, caplog, monkeypatch):
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")  # transformers multiplies float activations
    reference = rewrite_linear_weights(llama_128, tmp_path / "int4-dequantized", lambda w: _int4_round_trip(w, group))
    options = {} if group == INT4_GROUP_SIZE else {"quantization_config": {"group_size": group}}
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(str(llama_128), dtype="float32", quantization="int4", kv_cache_memory_bytes=8 << 20, **options)
    assert_greedy_equals_hf(llm, reference)
    model = model_runner(llm).model
    quantized = [m for m in model.modules() if hasattr(m, "weight_zero_point")]
    assert len(quantized) == 4 * model_runner(llm).model_config.num_layers  # qkv, o, gate_up, down
    assert all(m.weight.dtype == torch.uint8 for m in quantized)
    # Stored as Q4_0's blocks: a float16 scale per group, no zero points (symmetric).
    assert all(m.weight_scale.dtype == torch.float16 and m.weight_zero_point is None for m in quantized)
    assert model.lm_head.weight.dtype == torch.float32
    assert _groups(llm) == {128: {group}, 256: {group}}
    assert f"{len(quantized)} x int4: int4 weight-only, groups of {group}, float16 scales, symmetric (" in caplog.text


def test_default_groups_of_32_and_group_size_128_falls_back_to_32(tiny_llama):
    default = LLM(str(tiny_llama), quantization="int4", kv_cache_memory_bytes=8 << 20)  # hidden size 64
    assert all(sizes == {32} for sizes in _groups(default).values())
    del default
    llm = LLM(str(tiny_llama), quantization="int4", quantization_config={"group_size": 128}, kv_cache_memory_bytes=8 << 20)
    groups = _groups(llm)
    assert groups[64] == {32} and all(sizes == {128 if k % 128 == 0 else 32} for k, sizes in groups.items())
    assert int4_group_size(256, "x", 128) == 128 and int4_group_size(704, "x", 128) == 32
    assert int4_group_size(256, "x") == 32 and int4_group_size(96, "x", 64) == 32


def test_inputs_not_whole_groups_of_32_fail_naming_the_layer():
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.mlp\.down_proj has 48 inputs, not a multiple"):
        int4_group_size(48, "model.layers.0.mlp.down_proj", 128)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"quantization": "int4", "quantization_config": {"group_size": 48}},
         r"--quantization int4: group_size 48 is not supported; supported: 32, 64, 128 \(default 32\)"),
        ({"quantization": "int4", "quantization_config": {"group_size": 128, "bits": 3}},
         r"--quantization int4 does not read bits; it reads group_size"),
        ({"quantization": "int8", "quantization_config": {"group_size": 128}},
         r"--quantization int8 does not read group_size; it reads no keys"),
        ({"quantization_config": {"group_size": 128}}, r"--quantization-config needs --quantization int8\|int4\|fp8"),
    ],
)
def test_bad_quantization_config_fails_at_load(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), kv_cache_memory_bytes=8 << 20, **kwargs)
