"""Storing and multiplying 4- and 8-bit weights with a float32 scale and zero point per group
of inputs, W = scale * (Q - zero) per group: the form every integer format reaches
(``--quantization int4``, GPTQ, AWQ, compressed-tensors, GGUF's Q4_0 / Q4_1 / Q8_0).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.platforms import current_platform

#: ``PAGEDLLM_CPU_INT8_ACTIVATIONS=0`` keeps decode activations in float32 (the exact
#: dequantized-weight product); by default (1) the CPU kernels quantize them to int8 per block of
#: 32 inputs and use integer dot products, as llama.cpp does (``linear_w4``'s docstring).
INT8_ACTIVATIONS_ENV = "PAGEDLLM_CPU_INT8_ACTIVATIONS"


def int8_activations_enabled() -> bool:
    """Whether grouped layers run decode with int8 activations (``INT8_ACTIVATIONS_ENV``, read at
    load time; default on)."""
    return os.environ.get(INT8_ACTIVATIONS_ENV, "1").strip() not in ("0", "false", "False", "")


def store_grouped(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> None:
    """Replace ``layer.weight`` by ``bits``-bit Q (W = scale * (Q - zero) per group): Q [out,
    in] uint8 values below 2^bits, scale / zero [out, in / group] float32. On CPU with the
    kernels ``weight`` becomes the kernel's blocked layout (``pack_w4``'s [ceil(out / 16), in /
    2, 16] for 4 bits, ``pack_w8``'s [ceil(out / 16), in, 16] for 8), else Q itself;
    ``weight_scale`` / ``weight_zero_point`` hold scale and zero, ``weight_bits`` the width,
    ``int8_activations`` whether decode quantizes x (``int8_activations_enabled``)."""
    if current_platform.is_cpu and cpu_kernels.is_available():
        q = cpu_kernels.pack_w4(q) if bits == 4 else cpu_kernels.pack_w8(q.view(torch.int8)).view(torch.uint8)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)
    layer.weight_zero_point = nn.Parameter(zero.float().contiguous(), requires_grad=False)
    layer.weight_bits = bits
    layer.int8_activations = int8_activations_enabled()


def apply_grouped(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W^T + b`` for a layer prepared by ``store_grouped``: x [..., in] -> [..., out] in
    x's dtype (on CPU ``linear_w4`` / ``linear_w8g`` for few rows, ``linear_dequant`` for many,
    else a torch matmul on W dequantized per call)."""
    n = layer.output_size_per_partition
    if layer.weight.dim() == 3:
        bits, x2 = layer.weight_bits, x.reshape(-1, x.shape[-1])
        scale, zero = layer.weight_scale, layer.weight_zero_point
        if x2.shape[0] >= cpu_kernels.DEQUANT_GEMM_MIN_ROWS[bits]:
            y = cpu_kernels.linear_dequant(x2, layer.weight, scale, zero, bias, n, bits)
        else:
            kernel = cpu_kernels.linear_w4 if bits == 4 else cpu_kernels.linear_w8g
            y = kernel(x2, layer.weight, scale, zero, bias, n, layer.int8_activations)
        return y.view(*x.shape[:-1], n)
    group = layer.weight.shape[1] // layer.weight_scale.shape[1]
    scale = layer.weight_scale.repeat_interleave(group, dim=1)
    zero = layer.weight_zero_point.repeat_interleave(group, dim=1)
    return F.linear(x, (scale * (layer.weight.float() - zero)).to(x.dtype), bias)


def describe_grouped(layer: nn.Module, source: str) -> str:
    """The start-up log's name of a grouped layer's matmul path; ``source`` names the format."""
    bits = layer.weight_bits
    inputs = layer.input_size_per_partition
    group = inputs // layer.weight_scale.shape[1]
    kernel = ("linear_w4" if bits == 4 else "linear_w8g") if layer.weight.dim() == 3 else "torch matmul on dequantized W"
    if layer.weight.dim() == 3 and layer.int8_activations and group % 32 == 0:
        kernel += ", int8 activations per 32 inputs up to 16 rows"
    if layer.weight.dim() == 3:
        kernel += "; many rows: linear_dequant"
    return f"{source}: int{bits} weight-only, groups of {group} ({kernel})"
