"""``--quantization int4`` / ``fp8`` on mixture-of-experts models: every expert's W13 and W2
is quantized as the linear layers are (int4: groups of 32 inputs, one float16 scale each;
fp8: one scale per checkpoint matrix, gate / up / down), the router kept in the model dtype.
The engine's greedy output equals transformers' on the checkpoint with every linear and
expert weight replaced by its dequantized value (Mixtral's ``w1`` / ``w2`` / ``w3`` experts,
Qwen3-MoE's ``gate_proj`` / ``up_proj`` / ``down_proj`` ones beside a dense layer). Per-tensor
FP8 checkpoints' experts are read as they are; block-wise ones are refused, named."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.quantization.fp8 import Fp8Config
from pagedllm.model_executor.layers.quantization.grouped import INT8_ACTIVATIONS_ENV
from tests.helpers import (LINEAR_SUFFIXES, MIXTRAL_EXPERT_SUFFIXES, assert_greedy_equals_hf, check_block_accounting,
                           model_runner, rewrite_linear_weights)
from tests.model_executor.test_fp8 import _fp8_round_trip, _write_fp8_checkpoint
from tests.model_executor.test_int4 import _int4_round_trip

MODELS = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                           num_hidden_layers=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, intermediate_size=64, norm_topk_prob=True,
                                              decoder_sparse_step=2)),
}
ROUND_TRIPS = {"int4": _int4_round_trip, "fp8": _fp8_round_trip}


def _experts(llm: LLM) -> list[FusedMoE]:
    return [m for m in model_runner(llm).model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("quantization", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_quantized_experts_equal_transformers_on_dequantized_weights(checkpoint_factory, tmp_path, monkeypatch,
                                                                      model, quantization):
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")  # transformers multiplies float activations
    arch, config = MODELS[model]
    checkpoint = checkpoint_factory(arch, seed=7, **config)
    reference = rewrite_linear_weights(checkpoint, tmp_path / "dequantized", ROUND_TRIPS[quantization],
                                       LINEAR_SUFFIXES + MIXTRAL_EXPERT_SUFFIXES)
    llm = LLM(str(checkpoint), dtype="float32", quantization=quantization, kv_cache_memory_bytes=8 << 20)
    experts = _experts(llm)
    assert experts and not any(hasattr(m, "w13_weight") or hasattr(m, "w2_weight") for m in experts)
    matrices = [matrix for m in experts for matrix in (*m.w13_experts, *m.w2_experts)]
    assert len(matrices) == 2 * 8 * len(experts)
    if quantization == "int4":  # groups of 32: W13's 64 inputs in 2, W2's 32 in 1; Q4_0's float16 scales
        assert {w.weight_scale.shape[1] for m in experts for w in m.w13_experts} == {2}
        assert {w.weight_scale.shape[1] for m in experts for w in m.w2_experts} == {1}
        assert all(m.weight_bits == 4 and m.weight_scale.dtype == torch.float16 for m in matrices)
    else:  # one scale per checkpoint matrix: W13's gate rows and up rows, W2's rows
        assert all(m.weight.dtype == torch.float8_e4m3fn for m in matrices)
        w13 = experts[0].w13_experts[0].weight_scale
        assert w13.shape == (64,) and len(set(w13[:32].tolist())) == 1 and len(set(w13[32:].tolist())) == 1
        assert w13[0] != w13[32]
        assert len(set(experts[0].w2_experts[0].weight_scale.tolist())) == 1
    routers = [m.gate for m in model_runner(llm).model.modules() if hasattr(m, "experts")]
    assert routers and all(router.weight.dtype == torch.float32 for router in routers)
    assert_greedy_equals_hf(llm, reference)
    check_block_accounting(llm)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_fp8_checkpoint_experts_equal_transformers_on_dequantized_weights(checkpoint_factory, tmp_path, model):
    """A per-tensor FP8 checkpoint (``weight`` float8 and a scalar ``weight_scale`` per expert
    matrix, an unused ``input_scale``): the experts run on the FP8 kernel as they are."""
    arch, config = MODELS[model]
    _write_fp8_checkpoint(checkpoint_factory(arch, seed=7, **config), tmp_path / "fp8", tmp_path / "reference", None,
                          LINEAR_SUFFIXES + MIXTRAL_EXPERT_SUFFIXES)  # fmt: skip
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", kv_cache_memory_bytes=8 << 20)
    matrices = [matrix for m in _experts(llm) for matrix in (*m.w13_experts, *m.w2_experts)]
    assert matrices and {matrix.weight.dtype for matrix in matrices} == {torch.float8_e4m3fn}
    assert_greedy_equals_hf(llm, tmp_path / "reference")
    check_block_accounting(llm)


def test_experts_of_a_block_wise_fp8_checkpoint_are_refused_by_name():
    config = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    layer = FusedMoE(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
    with pytest.raises(ValueError, match=r"fp8: the experts model.layers.0.mlp.experts have block-wise scales"):
        config.get_quant_method(layer, "model.layers.0.mlp.experts")
