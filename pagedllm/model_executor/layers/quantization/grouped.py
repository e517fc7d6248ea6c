"""Storing and multiplying 4- and 8-bit weights with a scale and zero point per group of
inputs, W = scale * (Q - zero) per group: the form every integer format reaches
(``--quantization int4``, GPTQ, AWQ, compressed-tensors, GGUF's Q4_0 / Q4_1 / Q8_0).

Stored compactly, since decode streams them with the weights (at groups of 32, float32 scale
and zero add half again to a 4-bit weight's bytes): scales in float16 where that is exact (the
checkpoint formats' own float16 scales, ``--quantization int4``'s), and no zero points at all
for symmetric weights (zero 2^(bits - 1) everywhere: Q4_0, Q8_0, GPTQ sym, int4), as llama.cpp's
Q4_0 / Q8_0 blocks hold one float16 scale and nothing else.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm import envs
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers import cpu_gemm
from pagedllm.platforms import current_platform

#: ``PAGEDLLM_CPU_INT8_ACTIVATIONS=0`` keeps decode activations in float32 (the exact
#: dequantized-weight product); by default (1) the CPU kernels quantize them to int8 per block of
#: 32 inputs and use integer dot products, as llama.cpp does (``linear_w4``'s docstring).
INT8_ACTIVATIONS_ENV = envs.PAGEDLLM_CPU_INT8_ACTIVATIONS.name


def int8_activations_enabled() -> bool:
    """Whether grouped layers run decode with int8 activations (``INT8_ACTIVATIONS_ENV``, read at
    load time; default on)."""
    return envs.PAGEDLLM_CPU_INT8_ACTIVATIONS.get()


def compact_scales(scale: torch.Tensor, zero: torch.Tensor, bits: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(scale, zero) [out, groups] (any float dtype) as stored (see the module docstring): scale
    float16 if every value is exactly one, else float32; zero None if every value is 2^(bits -
    1), else float32."""
    scale32 = scale.float().contiguous()
    half = scale32.half()
    compact = half if torch.equal(half.float(), scale32) else scale32
    symmetric = bool((zero == 2 ** (bits - 1)).all())
    return compact, None if symmetric else zero.float().contiguous()


def store_grouped(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> None:
    """Replace ``layer.weight`` by ``bits``-bit Q (W = scale * (Q - zero) per group): Q [out,
    in] uint8 values below 2^bits, scale / zero [out, in / group] (any float dtype). On CPU with
    the kernels ``weight`` becomes the kernel's blocked layout (``pack_w4``'s [ceil(out / 16),
    in / 2, 16] for 4 bits, ``pack_w8``'s [ceil(out / 16), in, 16] for 8), else Q itself;
    ``weight_scale`` / ``weight_zero_point`` hold scale and zero as ``compact_scales`` returns
    them (zero None: symmetric), on CPU with the kernels blocked likewise (``pack_groups``:
    [ceil(out / 16), groups, 16]; dimension 1 is the groups either way), ``weight_bits`` the
    width, ``int8_activations`` whether decode quantizes x (``int8_activations_enabled``),
    ``gemm_plan`` the matmul (``cpu_gemm.GroupedGemm`` on CPU with the kernels, else
    ``cpu_gemm.GroupedTorchGemm``)."""
    scale, zero = compact_scales(scale, zero, bits)
    kernels = current_platform.is_cpu and cpu_kernels.is_available()
    if kernels:
        q = cpu_kernels.pack_w4(q) if bits == 4 else cpu_kernels.pack_w8(q.view(torch.int8)).view(torch.uint8)
        scale = cpu_kernels.pack_groups(scale)
        zero = None if zero is None else cpu_kernels.pack_groups(zero)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    layer.weight_zero_point = None if zero is None else nn.Parameter(zero, requires_grad=False)
    layer.weight_bits = bits
    layer.int8_activations = int8_activations_enabled()
    stored = layer.weight, layer.weight_scale, layer.weight_zero_point, bits
    if kernels:
        n = layer.output_size_per_partition
        layer.gemm_plan = cpu_gemm.GroupedGemm(*stored, n, layer.int8_activations)
    else:
        layer.gemm_plan = cpu_gemm.GroupedTorchGemm(*stored)


def apply_grouped(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W^T + b`` for a layer prepared by ``store_grouped``: x [..., in] -> [..., out] in
    x's dtype, by its plan."""
    return layer.gemm_plan(x, bias)


def describe_grouped(layer: nn.Module, source: str) -> str:
    """The start-up log's name of a grouped layer's matmul path; ``source`` names the format."""
    bits = layer.weight_bits
    inputs = layer.input_size_per_partition
    group = inputs // layer.weight_scale.shape[1]
    blocked = isinstance(layer.gemm_plan, cpu_gemm.GroupedGemm)
    kernel = ("linear_w4" if bits == 4 else "linear_w8g") if blocked else "torch matmul on dequantized W"
    if blocked and layer.int8_activations and group % 32 == 0:
        kernel += ", int8 activations per 32 inputs up to 16 rows"
    if blocked:
        kernel += "; many rows: linear_dequant"
    stored = f"{'float16' if layer.weight_scale.dtype == torch.float16 else 'float32'} scales"
    stored += ", symmetric" if layer.weight_zero_point is None else ", zero points"
    return f"{source}: int{bits} weight-only, groups of {group}, {stored} ({kernel})"
