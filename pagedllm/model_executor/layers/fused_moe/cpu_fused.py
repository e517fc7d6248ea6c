"""The fused C++ expert kernel on CPU (``pagedllm.kernels.cpu.fused_moe``): which layers it
serves, the weight layout it needs, and its call.

A layer it serves computes all its routed experts in one kernel call per step (one parallel
region over the active experts' weight blocks; see ``fused_moe.cpp``) instead of a Python loop
of two GEMM plans per active expert. It serves unquantized CPU layers in bfloat16, float16 or
float32 whose activation is "silu" (SwiGLU) or "relu2_no_mul" (the ungated squared ReLU).
Weight-only int8 experts (``--quantization int8``) run on the same kernel's int8 entry
(``fused_moe_w8``: int8 blocks widened in registers, per-channel scales, float32 activations),
packed by ``pack_int8_for_fused_kernel``. gpt-oss's clamped "swigluoai" stays on the torch
path: its clamp, alpha and the ``up + 1`` term are a third activation the kernel does not
carry, for one model family that is also served in MXFP4.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.fused_moe.expert_groups import ExpertGroups
from pagedllm.platforms import current_platform

#: The activations the kernel computes (``FusedMoE.activation``).
FUSED_ACTIVATIONS = ("silu", "relu2_no_mul")
#: The expert weight dtypes it reads.
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Experts packed per call at load.
_PACK_CHUNK = 8


def can_fuse(layer: nn.Module) -> bool:
    """Whether ``layer`` (a loaded ``FusedMoE`` with stacked ``w13_weight`` / ``w2_weight``)
    is to run on the fused kernel: a CPU platform with the C++ kernels available, a weight
    dtype of ``FUSED_DTYPES`` (for int8 experts: the loaded weights, before quantization) and
    an activation of ``FUSED_ACTIVATIONS``."""
    return (
        current_platform.is_cpu
        and hasattr(layer, "w13_weight")
        and layer.w13_weight.dtype in FUSED_DTYPES
        and getattr(layer, "activation", None) in FUSED_ACTIVATIONS
        and cpu_kernels.is_available()
    )


def pack_for_fused_kernel(layer: nn.Module) -> None:
    """Replace ``layer``'s ``w13_weight`` [E, N13, H] / ``w2_weight`` [E, H, I] by
    ``w13_packed`` [E, ceil(N13 / 16), H, 16] / ``w2_packed`` [E, ceil(H / 16), I, 16]
    (``cpu_kernels.pack_experts``), ``_PACK_CHUNK`` experts at a time (one thread per expert)
    so that the peak holds a few extra experts' matrices, not a second copy of the layer. Call
    only when ``can_fuse(layer)``."""
    for name in ("w13", "w2"):
        weight = getattr(layer, f"{name}_weight").data
        n, k = weight.shape[1], weight.shape[2]
        packed = torch.empty((weight.shape[0], (n + 15) // 16, k, 16), dtype=weight.dtype)
        for first in range(0, weight.shape[0], _PACK_CHUNK):
            packed[first : first + _PACK_CHUNK] = cpu_kernels.pack_experts(weight[first : first + _PACK_CHUNK])
        delattr(layer, f"{name}_weight")
        layer.register_parameter(f"{name}_packed", nn.Parameter(packed, requires_grad=False))


def pack_int8_for_fused_kernel(layer: nn.Module,
                               quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Replace ``layer``'s ``w13_weight`` [E, N13, H] / ``w2_weight`` [E, H, I] (any float
    dtype) by int8 ``w13_packed`` [E, ceil(N13 / 16), H, 16] / ``w2_packed`` [E, ceil(H / 16),
    I, 16] and float32 ``w13_scale`` [E, N13] / ``w2_scale`` [E, H]: each expert's matrix
    quantized by ``quantize(W [N, K]) -> (Q [N, K] int8, scale [N] float32)`` and packed
    (``cpu_kernels.pack_experts``), ``_PACK_CHUNK`` experts at a time. Call only when
    ``can_fuse(layer)``."""
    for name in ("w13", "w2"):
        weight = getattr(layer, f"{name}_weight").data
        experts, n, k = weight.shape
        packed = torch.empty((experts, (n + 15) // 16, k, 16), dtype=torch.int8)
        scale = torch.empty((experts, n), dtype=torch.float32)
        for first in range(0, experts, _PACK_CHUNK):
            chunk = range(first, min(first + _PACK_CHUNK, experts))
            q = torch.empty((len(chunk), n, k), dtype=torch.int8)
            for i, expert in enumerate(chunk):
                q[i], scale[expert] = quantize(weight[expert])
            packed[first : first + len(chunk)] = cpu_kernels.pack_experts(q)
        delattr(layer, f"{name}_weight")
        layer.register_parameter(f"{name}_packed", nn.Parameter(packed, requires_grad=False))
        layer.register_parameter(f"{name}_scale", nn.Parameter(scale, requires_grad=False))


def fused_kernel_experts(layer: nn.Module, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """x [T, H] -> [T, H] in x's dtype: the sum over each token's choices of weight x expert(x)
    for a layer packed by ``pack_for_fused_kernel`` or ``pack_int8_for_fused_kernel`` (W2's
    bias added by tensor-parallel rank 0 only, as the torch path)."""
    w13_bias = w2_bias = None
    if getattr(layer, "has_bias", False):
        w13_bias = layer.w13_bias
        w2_bias = layer.w2_bias if layer.moe_tp_rank == 0 else None
    if layer.w13_packed.dtype == torch.int8:
        return cpu_kernels.fused_moe_w8(x, groups.token_rows, groups.weights, groups.counts, layer.w13_packed,
                                        layer.w2_packed, layer.w13_scale, layer.w2_scale, layer.activation,
                                        w13_bias, w2_bias)
    return cpu_kernels.fused_moe(x, groups.token_rows, groups.weights, groups.counts, layer.w13_packed,
                                 layer.w2_packed, layer.activation, w13_bias, w2_bias)


def describe(layer: nn.Module) -> str:
    """The path's name in the start-up log."""
    dtype = str(layer.w13_packed.dtype).removeprefix("torch.")
    blocks = "int8 weight-only blocks, per-channel scales" if dtype == "int8" else f"{dtype} blocks"
    return f"experts: fused C++ kernel ({blocks}, {cpu_kernels.build_info().split(',')[0]})"
