"""GPTQ, AWQ and compressed-tensors (pack-quantized) checkpoints of mixture-of-experts models
(per-expert quantized tensors, ``experts.<e>.w1.qweight`` / ``qzeros`` / ``scales`` (/
``g_idx``) as AutoGPTQ and AutoAWQ write them, ``weight_packed`` ... as compressed-tensors
does, the router left in float): every expert matrix runs on the integer kernels the
linear layers use, and the engine's greedy output equals transformers' on the checkpoint with
every linear and expert weight replaced by its dequantized value (Mixtral's ``w1`` / ``w2`` /
``w3`` experts, Qwen3-MoE's ``gate_proj`` / ``up_proj`` / ``down_proj`` beside a dense layer).
Act-order GPTQ experts and malformed expert tensors (a missing scale, a wrong shape, a float
expert, a ``weight_shape`` that does not fit) are refused at load, named."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.quantization.grouped import INT8_ACTIVATIONS_ENV
from tests.helpers import (LINEAR_SUFFIXES, MIXTRAL_EXPERT_SUFFIXES, assert_greedy_equals_hf, can_host_workers,
                           check_block_accounting, model_runner)
from tests.model_executor.test_moe_quantization import MODELS
from tests.model_executor.test_packed_int_formats import _write, awq, compressed_tensors, gptq

#: name -> (checkpoint writer, the expert matrices' weight dtype once loaded: uint8 = grouped
#: linear_w4 / linear_w8g, int8 = linear_w8 (symmetric, per channel)).
FORMATS = {
    "gptq-4bit-g32-sym": (lambda: gptq(4, 32, desc_act=False, sym=True), torch.uint8),
    "gptq-8bit-channel-sym": (lambda: gptq(8, -1, desc_act=False, sym=True), torch.int8),
    "awq-4bit-g32": (lambda: awq(32), torch.uint8),
    "compressed-tensors-w4a16-g32-asym": (lambda: compressed_tensors(4, "group", sym=False), torch.uint8),
    "compressed-tensors-w8a16-channel-sym": (lambda: compressed_tensors(8, "channel", sym=True), torch.int8),
}
SUFFIXES = LINEAR_SUFFIXES + MIXTRAL_EXPERT_SUFFIXES


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")  # transformers multiplies float32 activations


def _checkpoint(checkpoint_factory, model: str):
    arch, config = MODELS[model]
    return checkpoint_factory(arch, seed=7, **config)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_quantized_experts_equal_transformers_on_dequantized_weights(checkpoint_factory, tmp_path, model, fmt):
    writer, weight_dtype = FORMATS[fmt]
    config, convert = writer()
    quantized, reference = _write(_checkpoint(checkpoint_factory, model), tmp_path / "q", tmp_path / "ref", config,
                                  convert, SUFFIXES)  # fmt: skip
    llm = LLM(str(quantized), dtype="float32", kv_cache_memory_bytes=8 << 20)
    experts = [m for m in model_runner(llm).model.modules() if isinstance(m, FusedMoE)]
    matrices = [matrix for m in experts for matrix in (*m.w13_experts, *m.w2_experts)]
    assert experts and len(matrices) == 2 * 8 * len(experts)
    assert {matrix.weight.dtype for matrix in matrices} == {weight_dtype}
    assert_greedy_equals_hf(llm, reference)
    check_block_accounting(llm)


def _rewrite(path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.scales"),
         r"lacks expert weights of model\.layers\.1\.mlp\.experts: expert 5 w3 scales"),
        (lambda t: t.update({"model.layers.1.mlp.experts.2.down_proj.qweight":
                             t["model.layers.1.mlp.experts.2.down_proj.qweight"][:2]}),
         r"'model\.layers\.1\.mlp\.experts\.2\.down_proj\.qweight'.*dimension 1 should be 32"),
        (lambda t: t.update({"model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64)}),
         r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight' has no matching parameter: the experts of "
         r"model\.layers\.1\.mlp\.experts hold g_idx, qweight, qzeros, scales \(GPTQFusedMoEMethod\)"),
    ],
    ids=["missing-scales", "wrong-shape", "float-expert"],
)
def test_malformed_expert_tensors_are_refused_by_name(checkpoint_factory, tmp_path, edit, message):
    _refused(checkpoint_factory, tmp_path, gptq(4, 32, desc_act=False, sym=True), edit, message)


def test_a_wrong_compressed_tensors_weight_shape_is_refused_by_name(checkpoint_factory, tmp_path):
    name = "model.layers.1.mlp.experts.4.down_proj.weight_shape"
    _refused(checkpoint_factory, tmp_path, compressed_tensors(4, "group", sym=True),
             lambda t: t.update({name: torch.tensor([64, 64])}),
             rf"compressed-tensors: checkpoint tensor '{name}': weight_shape \[64, 64\]; "
             r"the experts' matrix is \[64, 32\]")


def _refused(checkpoint_factory, tmp_path, writer, edit, message) -> None:
    config, convert = writer
    quantized, _ = _write(_checkpoint(checkpoint_factory, "qwen3_moe"), tmp_path / "q", tmp_path / "ref", config,
                          convert, SUFFIXES)  # fmt: skip
    _rewrite(quantized, edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(quantized), dtype="float32", kv_cache_memory_bytes=8 << 20)


def test_act_order_experts_are_refused_by_name(checkpoint_factory, tmp_path):
    config, convert = gptq(4, 32, desc_act=True, sym=False)
    quantized, _ = _write(_checkpoint(checkpoint_factory, "mixtral"), tmp_path / "q", tmp_path / "ref", config,
                          convert, SUFFIXES)  # fmt: skip
    with pytest.raises(ValueError, match=r"gptq: checkpoint tensor 'model\.layers\.0\.mlp\.experts\.0\.w1\.g_idx': "
                                         r"act-order \(desc_act\) groups are not supported for experts yet"):
        LLM(str(quantized), dtype="float32", kv_cache_memory_bytes=8 << 20)


@pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")
@pytest.mark.parametrize("enable_expert_parallel", [False, True], ids=["tp", "ep"])
def test_gptq_experts_over_two_workers(checkpoint_factory, tmp_path, enable_expert_parallel):
    """``-tp 2``: each worker loads its half of every expert's intermediate columns (W13's rows,
    W2's packed inputs with their scale and zero-point groups); with expert parallelism, its
    whole experts. Greedy equal to transformers on the dequantized weights either way."""
    arch, config = MODELS["qwen3_moe"]
    checkpoint = checkpoint_factory(arch, seed=7, **{**config, "moe_intermediate_size": 64})
    gptq_config, convert = gptq(4, 32, desc_act=False, sym=False)
    quantized, reference = _write(checkpoint, tmp_path / "q", tmp_path / "ref", gptq_config, convert, SUFFIXES)
    llm = LLM(str(quantized), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=enable_expert_parallel,
              kv_cache_memory_bytes=8 << 20)
    try:
        assert_greedy_equals_hf(llm, reference)
        check_block_accounting(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
