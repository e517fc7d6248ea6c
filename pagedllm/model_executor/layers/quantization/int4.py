"""The "int4" format: weight-only 4-bit quantization of a 16/32-bit checkpoint at load time
(``--quantization int4``), symmetric, one scale per group of ``INT4_GROUP_SIZE`` inputs:

    m[n, g] = the weight of largest magnitude in the group (sign kept),
    scale[n, g] = m / -8,   Q[n, k] = clamp(round(W[n, k] / scale) + 8, 0, 15),

so W ~ scale * (Q - 8): llama.cpp's Q4_0 arithmetic (the extreme weight maps exactly onto -8,
using all 16 levels), with groups of 128 inputs as GPTQ / AWQ checkpoints use rather than
Q4_0's 32 (fewer scale bytes per weight). Activations stay in the model dtype. The storage and
matmul (``store_int4`` / ``apply_int4``) are shared with the 4-bit checkpoint formats, which
bring their own Q, scales and zero points. The lm_head keeps the model dtype, as with int8.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedllm.platforms import current_platform

#: Inputs per scale of ``--quantization int4``.
INT4_GROUP_SIZE = 128


def quantize_int4_per_group(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype, K a multiple of ``group_size``) -> (Q [N, K] uint8 in
    [0, 15], scale [N, K / group_size] float32, zero [N, K / group_size] float32, all 8) with
    W ~ scale * (Q - zero) per group (see the module docstring); an all-zero group gets scale 1.

    Raises:
        ValueError: K not a multiple of ``group_size``.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"{k} inputs are not a whole number of int4 groups of {group_size}.")
    w = weight.float().view(n, k // group_size, group_size)
    extreme = w.gather(2, w.abs().argmax(dim=2, keepdim=True)).squeeze(2)
    scale = torch.where(extreme != 0, extreme / -8.0, torch.ones_like(extreme))
    q = (torch.round(w / scale[..., None]) + 8).clamp_(0, 15).to(torch.uint8).view(n, k)
    return q, scale.contiguous(), torch.full_like(scale, 8.0)


def store_int4(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
    """Replace ``layer.weight`` by 4-bit Q (W = scale * (Q - zero) per group): Q [out, in]
    uint8 values 0-15, scale / zero [out, in / group] float32. On CPU with the kernels
    ``weight`` becomes ``pack_w4``'s [ceil(out / 16), in / 2, 16] uint8, else Q itself;
    ``weight_scale`` and ``weight_zero_point`` hold scale and zero."""
    if current_platform.is_cpu and cpu_kernels.is_available():
        q = cpu_kernels.pack_w4(q)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)
    layer.weight_zero_point = nn.Parameter(zero.float().contiguous(), requires_grad=False)


def apply_int4(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W^T + b`` for a layer prepared by ``store_int4``: x [..., in] -> [..., out] in x's
    dtype (``linear_w4`` on CPU, else a torch matmul on W dequantized per call)."""
    n = layer.output_size_per_partition
    if layer.weight.dim() == 3:
        y = cpu_kernels.linear_w4(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale,
                                  layer.weight_zero_point, bias, n)  # fmt: skip
        return y.view(*x.shape[:-1], n)
    group = layer.weight.shape[1] // layer.weight_scale.shape[1]
    scale = layer.weight_scale.repeat_interleave(group, dim=1)
    zero = layer.weight_zero_point.repeat_interleave(group, dim=1)
    return F.linear(x, (scale * (layer.weight.float() - zero)).to(x.dtype), bias)


def describe_int4(layer: nn.Module, source: str) -> str:
    """The start-up log's name of an int4 layer's matmul path; ``source`` names the format."""
    group = 2 * layer.weight.shape[1] // layer.weight_scale.shape[1] if layer.weight.dim() == 3 else (
        layer.weight.shape[1] // layer.weight_scale.shape[1])
    kernel = "linear_w4" if layer.weight.dim() == 3 else "torch matmul on dequantized W"
    return f"{source}: int4 weight-only, groups of {group} ({kernel})"


class Int4Config(QuantizationConfig):
    """Every linear layer gets ``Int4LinearMethod`` (groups of ``INT4_GROUP_SIZE``); the
    lm_head keeps its own method."""

    @classmethod
    def get_name(cls) -> str:
        return "int4"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Int4Config":
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        return Int4LinearMethod(prefix) if isinstance(layer, LinearBase) else None


class Int4LinearMethod(UnquantizedLinearMethod):
    """Loads W like the unquantized method, then keeps only its int4 form (``store_int4``)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize the loaded weight (see the module docstring); a second call changes nothing.

        Raises:
            ValueError: the layer's input size is not a multiple of ``INT4_GROUP_SIZE`` (named).
        """
        if hasattr(layer, "weight_zero_point"):
            return
        k = layer.weight.shape[1]
        if k % INT4_GROUP_SIZE:
            raise ValueError(
                f"--quantization int4: layer {self.prefix} has {k} inputs, not a multiple of the "
                f"group size {INT4_GROUP_SIZE}; use --quantization int8 for this model."
            )
        store_int4(layer, *quantize_int4_per_group(layer.weight.data, INT4_GROUP_SIZE))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_int4(layer, x, bias)

    def describe_path(self, layer: nn.Module) -> str:
        return describe_int4(layer, "int4")
