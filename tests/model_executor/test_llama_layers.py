"""Layer-level behaviour of our Llama: the CPU MLP's row chunking and the pre-packed
(oneDNN) linear weights give the same numbers as the plain computation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagedllm.kernels import isa
from pagedllm.model_executor.layers import cpu_gemm
from pagedllm.model_executor.layers import linear as linear_mod
from pagedllm.model_executor.models import llama
from tests.helpers import cpu_only


def tiny_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_hidden_layers=1,
                       vocab_size=100)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_row_chunks_equal_one_pass(monkeypatch, dtype):
    torch.manual_seed(0)
    mlp = llama.LlamaMLP(tiny_config(), None, "mlp").to(dtype)
    for p in mlp.parameters():
        p.data.normal_(std=0.2)
    x = torch.randn(300, 64, dtype=dtype)
    whole = mlp(x)
    row_bytes = mlp.gate_up_proj.output_size_per_partition * x.element_size()
    monkeypatch.setattr(llama, "_CPU_MLP_CHUNK_BYTES", 64 * row_bytes)  # 64-row chunks: 5 of them
    assert mlp._chunk_rows(x) == 64
    chunked = mlp(x)
    if dtype == torch.float32:  # BLAS may block K differently for another M: last-bit differences
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(chunked, whole)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 32, 300])
def test_linear_layer_takes_this_machines_path_and_matches_plain(kernel, dtype, num_tokens):
    """After loading, a layer's weight is oneDNN-packed where oneDNN can pack its dtype on
    this CPU (float32; bf16 with native bf16), else a plain 16-bit weight multiplied by
    ``linear_w16`` in blocks of 16 outputs (bf16 without native bf16, and fp16); either way the product is the plain
    one up to float32 summation order and the output's rounding."""
    layer = linear_mod.ReplicatedLinear(96, 200, bias=True).to(dtype)
    torch.manual_seed(1)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(num_tokens, 96, dtype=dtype)
    plain = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    packable = cpu_gemm.can_pack(layer.weight.data)
    native_bf16 = isa.selected_isa() == "avx512_bf16" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert packable == (dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.is_mkldnn == packable
    if packable:
        assert layer.weight.shape == (200, 96)
    else:  # pack_w16's blocks of 16 outputs
        assert layer.weight.shape == (13, 96, 16) and "(linear_w16)" in layer.quant_method.describe_path(layer)
    out = layer(x)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-4)
    else:  # float32 sums of exact 16-bit products, rounded once to the dtype
        torch.testing.assert_close(out.float(), plain, rtol=2 * torch.finfo(dtype).eps, atol=1e-2)


def test_packing_off_by_env(disable_cpu_kernels):
    disable_cpu_kernels()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # no oneDNN packing, no linear_w16
        layer = linear_mod.ReplicatedLinear(16, 8, bias=False).to(dtype)
        layer.weight.data.normal_()
        layer.quant_method.process_weights_after_loading(layer)
        assert not layer.weight.is_mkldnn and layer.weight.shape == (8, 16) and layer.weight_fp32 is None
        x = torch.randn(3, 16, dtype=dtype)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    assert not cpu_gemm.can_pack(torch.empty(8, 16, dtype=torch.float64))


@cpu_only
def test_layer_plan_is_chosen_once_at_load(kernel):
    """A layer multiplies by torch's matmul until its weights are prepared; then by the plan
    chosen for this machine (fp16: oneDNN never packs it, ``linear_w16``), which a second
    preparation keeps."""
    layer = linear_mod.ReplicatedLinear(16, 8, bias=False).to(torch.float16)
    layer.weight.data.normal_()
    assert isinstance(layer.gemm_plan, cpu_gemm.TorchGemm)
    x = torch.randn(3, 16, dtype=torch.float16)
    expected = torch.nn.functional.linear(x.float(), layer.weight.float())
    layer.quant_method.process_weights_after_loading(layer)
    plan = layer.gemm_plan
    assert isinstance(plan, cpu_gemm.WidenedGemm) and plan.weight is layer.weight and plan.n == 8
    assert layer.quant_method.describe_path(layer) == plan.describe()
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.gemm_plan is plan
    torch.testing.assert_close(layer(x).float(), expected, rtol=2e-3, atol=1e-2)
