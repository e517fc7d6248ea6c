"""The "int8" format: weight-only int8 quantization of a 16/32-bit checkpoint at load time
(``--quantization int8``), symmetric with one scale per output channel:

    scale[n] = max_k |W[n, k]| / 127,   Q[n, k] = round(W[n, k] / scale[n]) in [-127, 127],

so W ~ scale[:, None] * Q (the per-channel absmax scheme of LLM.int8(), Dettmers et al. 2022,
without its outlier decomposition; llama.cpp's Q8_0 uses blocks of 32 instead of channels).
On a CPU with VNNI (the kernels' avx512_bf16 level; AMX-INT8 where present) and int8
activations enabled (``PAGEDLLM_CPU_INT8_ACTIVATIONS``, default on, as for the grouped
formats), Q is stored in oneDNN's packed int8 layout and every matmul quantizes x to int8 per
row (dynamic per-token, as vLLM's W8A8 int8 layers) for oneDNN's exact int8 GEMM
(``linear_dequant`` on such a weight): half of bf16's weight bytes at twice its multiply rate.
Elsewhere (or with ``PAGEDLLM_CPU_INT8_ACTIVATIONS=0``) activations stay in the model dtype:
``pagedllm.kernels.cpu.linear_w8`` streams one byte per weight for decode steps and sums in
float32, and many rows (prefill) go through ``linear_dequant``, tiles of W dequantized into a
bf16 GEMM. The lm_head keeps the model dtype (its error reaches the logits directly), as vLLM's
weight-only methods do. ``FusedMoE`` experts (``Int8FusedMoEMethod``): each expert's W13 and
W2 quantized the same way; on CPU with the kernels all experts of a layer in one fused call
(``fused_moe_w8``, weight-only), else one plan per matrix; routers stay in the model dtype.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels import isa
from pagedllm.model_executor.layers import cpu_gemm
from pagedllm.model_executor.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod, cpu_fused
from pagedllm.model_executor.layers.fused_moe.methods import split_experts
from pagedllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.layers.quantization.grouped import int8_activations_enabled
from pagedllm.platforms import current_platform


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (Q [N, K] int8 in [-127, 127], scale [N] float32) with
    W ~ scale[:, None] * Q; an all-zero row gets scale 1 (its Q is 0)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


class Int8Config(QuantizationConfig):
    """Every linear layer gets ``Int8LinearMethod``, every ``FusedMoE`` ``Int8FusedMoEMethod``;
    the lm_head keeps its own method."""

    @classmethod
    def get_name(cls) -> str:
        return "int8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Int8Config":
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, FusedMoE):
            return Int8FusedMoEMethod()
        return Int8LinearMethod() if isinstance(layer, LinearBase) else None


def int8_gemm_exact_on_cpu() -> bool:
    """Whether oneDNN's int8 GEMMs (``torch._int_mm``, its quantized linear ops) sum exactly
    in int32 here: a CPU at the kernels' avx512_bf16 level (AVX512-VNNI, or AMX-INT8); without
    VNNI oneDNN's int8 kernels saturate int16 pairs (``vpmaddubsw``)."""
    return current_platform.is_cpu and isa.selected_isa() == "avx512_bf16"


def onednn_int8_gemm_exact() -> bool:
    """``int8_gemm_exact_on_cpu()``, with the CPU kernels available and torch built with
    oneDNN's quantized linear ops (``onednn::qlinear_prepack``)."""
    return (
        int8_gemm_exact_on_cpu()
        and cpu_kernels.is_available()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.onednn, "qlinear_prepack")
    )


def store_int8(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, int8_activations: bool = False) -> None:
    """Replace ``layer.weight`` by int8 Q (W = scale[:, None] * Q): Q [out, in] int8, scale
    [out] float32 in ``weight_scale``, and set ``layer.gemm_plan``. With ``int8_activations``
    where ``onednn_int8_gemm_exact()``, ``weight`` becomes oneDNN's packed int8 layout
    (``onednn::qlinear_prepack``, an opaque mkldnn tensor of shape [in, out]; plan
    ``OneDnnInt8Gemm``); else on CPU with the kernels ``pack_w8``'s [ceil(out / 16), in, 16]
    int8 (``Scaled8BitGemm`` with ``linear_w8``); else Q itself (``DequantizedTorchGemm``)."""
    onednn = int8_activations and onednn_int8_gemm_exact()
    kernels = not onednn and current_platform.is_cpu and cpu_kernels.is_available()
    if onednn:
        q = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)
    elif kernels:
        q = cpu_kernels.pack_w8(q)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)
    weight, scale, n = layer.weight, layer.weight_scale, layer.output_size_per_partition
    if onednn:
        layer.gemm_plan = cpu_gemm.OneDnnInt8Gemm(weight, scale, n)
    elif kernels:
        layer.gemm_plan = cpu_gemm.Scaled8BitGemm(weight, scale, n, cpu_kernels.linear_w8)
    else:
        layer.gemm_plan = cpu_gemm.DequantizedTorchGemm(weight, scale)


def apply_int8(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W^T + b`` for a layer prepared by ``store_int8``: x [..., in] -> [..., out] in x's
    dtype, by its plan."""
    return layer.gemm_plan(x, bias)


def describe_int8(layer: nn.Module) -> str:
    """The start-up log's name of an int8 layer's matmul path."""
    if isinstance(layer.gemm_plan, cpu_gemm.OneDnnInt8Gemm):
        return "int8 weights, per-channel scales, int8 activations per token (oneDNN int8 GEMM)"
    if isinstance(layer.gemm_plan, cpu_gemm.Scaled8BitGemm):
        return "int8 weight-only, per-channel scales (linear_w8; many rows: linear_dequant)"
    return "int8 weight-only, per-channel scales (torch matmul on dequantized W)"


class Int8LinearMethod(UnquantizedLinearMethod):
    """Loads W like the unquantized method, then keeps only its int8 form (``store_int8``)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize the loaded weight (see the module docstring); a second call changes nothing."""
        if layer.weight.dtype == torch.int8:
            return
        store_int8(layer, *quantize_int8_per_channel(layer.weight.data), int8_activations_enabled())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_int8(layer, x, bias)

    def describe_path(self, layer: nn.Module) -> str:
        return describe_int8(layer)


class Int8FusedMoEMethod(UnquantizedFusedMoEMethod):
    """Loads the experts like the unquantized method, then keeps each expert's W13 [2 x I, H]
    and W2 [H, I] only in int8 form, per output channel.

    On CPU with the C++ kernels and a "silu" / "relu2_no_mul" layer (``cpu_fused.can_fuse``),
    the experts are packed for the fused kernel's int8 entry (``fused_moe_w8``: one call per
    layer, int8 widened in registers, float32 activations) and every step runs on it, prefill
    included. Measured on the Qwen3-30B-A3B-shaped cut (docs/benchmarks.md, "Mixture of
    experts"): it beats the per-expert plans at batch 1, and at a 128-token prefill it beats
    their weight-only form (``linear_dequant``); only oneDNN's int8 GEMM with int8 activations
    (the per-expert plans' choice under ``PAGEDLLM_CPU_INT8_ACTIVATIONS`` on a VNNI / AMX CPU)
    prefills faster, at the price of quantizing activations and a second copy of every expert
    in oneDNN's layout, so prefill stays on the fused kernel.
    Elsewhere ``store_int8`` on each of ``fused_moe.methods.split_experts``' matrices: one
    plan per expert matrix, a Python loop over the active experts."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize the loaded experts; a second call changes nothing."""
        if cpu_fused.can_fuse(layer):
            cpu_fused.pack_int8_for_fused_kernel(layer, quantize_int8_per_channel)
            return
        int8_activations = int8_activations_enabled()
        split_experts(layer, lambda m: store_int8(m, *quantize_int8_per_channel(m.weight.data), int8_activations))

    def describe_path(self, layer: nn.Module) -> str:
        if hasattr(layer, "w13_packed"):
            return cpu_fused.describe(layer)
        return f"experts: {describe_int8(layer.w13_experts[0])}" if len(layer.w13_experts) else "experts: int8"
