"""The "int4" format: weight-only 4-bit quantization of a 16/32-bit checkpoint at load time
(``--quantization int4``), symmetric, one scale per group of inputs:

    m[n, g] = the weight of largest magnitude in the group (sign kept),
    scale[n, g] = float16(m / -8),   Q[n, k] = clamp(round(W[n, k] / scale) + 8, 0, 15),

so W ~ scale * (Q - 8): llama.cpp's Q4_0 arithmetic (the extreme weight maps onto -8, exactly
up to the float16 scale's rounding, using all 16 levels; a float16 scale, no zero points: the
bytes of a Q4_0 block, ``grouped.compact_scales``), and by default Q4_0's groups of 32 inputs
(``INT4_GROUP_SIZE``): on the shipped model +0.12% perplexity over bf16, against +0.67% with
groups of 128 and +0.16% for llama.cpp's own Q4_0 (docs/benchmarks.md). ``--quantization-config '{"group_size": 128}'``
(vLLM's ``quantization_config`` engine argument; ``LLM(..., quantization_config={...})``)
chooses 64 or 128 instead, as GPTQ / AWQ checkpoints use: fewer scale bytes per weight, a
little more error; a layer whose inputs are not whole groups of that size gets groups of 32.
The start-up log names each layer's group size. Activations stay in the model dtype. The
storage and matmul (``grouped.py``) are shared with the checkpoint formats, which bring their
own Q, scales and zero points. The lm_head keeps the model dtype, as with int8. ``FusedMoE``
experts (``Int4FusedMoEMethod``): each expert's W13 and W2 quantized the same way (groups
chosen per matrix: W13's inputs are the hidden size, W2's the intermediate), one plan per
matrix; routers stay in the model dtype.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.model_executor.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod
from pagedllm.model_executor.layers.fused_moe.methods import split_experts
from pagedllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.layers.quantization.grouped import apply_grouped, describe_grouped, store_grouped

#: Inputs per scale of ``--quantization int4`` unless ``group_size`` says otherwise (Q4_0's),
#: and the fallback where a layer's inputs are not a multiple of the chosen size.
INT4_GROUP_SIZE = 32
#: The ``group_size`` values ``--quantization-config`` may choose.
INT4_GROUP_SIZES = (32, 64, 128)


def int4_group_size(num_inputs: int, prefix: str, group_size: int = INT4_GROUP_SIZE) -> int:
    """``group_size`` if ``num_inputs`` is a multiple of it, else ``INT4_GROUP_SIZE`` (32).

    Raises:
        ValueError: ``num_inputs`` is a multiple of neither (names the layer ``prefix``).
    """
    for group in (group_size, INT4_GROUP_SIZE):
        if num_inputs % group == 0:
            return group
    raise ValueError(
        f"--quantization int4: layer {prefix} has {num_inputs} inputs, not a multiple of the group size "
        f"{INT4_GROUP_SIZE}; use --quantization int8 for this model."
    )


def quantize_int4_per_group(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype, K a multiple of ``group_size``) -> (Q [N, K] uint8 in
    [0, 15], scale [N, K / group_size] float32, zero [N, K / group_size] float32, all 8) with
    W ~ scale * (Q - zero) per group (see the module docstring); an all-zero group gets scale 1.
    The scales are float16 values (as Q4_0's), except where m / -8 is below float16's range
    (|m| < 2.4e-7 or > 5.2e5), which keep float32.

    Raises:
        ValueError: K not a multiple of ``group_size``.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"{k} inputs are not a whole number of int4 groups of {group_size}.")
    w = weight.float().view(n, k // group_size, group_size)
    extreme = w.gather(2, w.abs().argmax(dim=2, keepdim=True)).squeeze(2)
    scale = torch.where(extreme != 0, extreme / -8.0, torch.ones_like(extreme))
    half = scale.half().float()
    scale = torch.where((half != 0) & half.isfinite(), half, scale)
    q = (torch.round(w / scale[..., None]) + 8).clamp_(0, 15).to(torch.uint8).view(n, k)
    return q, scale.contiguous(), torch.full_like(scale, 8.0)


class Int4Config(QuantizationConfig):
    """Every linear layer gets ``Int4LinearMethod`` (groups of ``int4_group_size(...,
    group_size)``), every ``FusedMoE`` ``Int4FusedMoEMethod``; the lm_head keeps its own method.

    Args:
        group_size: inputs per scale, one of ``INT4_GROUP_SIZES`` (default 32).

    Raises (``from_config``):
        ValueError: a ``group_size`` not in ``INT4_GROUP_SIZES`` (names the supported ones).
    """

    online_config_keys = ("group_size",)

    def __init__(self, group_size: int = INT4_GROUP_SIZE) -> None:
        self.group_size = group_size

    @classmethod
    def get_name(cls) -> str:
        return "int4"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Int4Config":
        group_size = config.get("group_size", INT4_GROUP_SIZE)
        if isinstance(group_size, bool) or group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"--quantization int4: group_size {group_size!r} is not supported; supported: "
                f"{', '.join(map(str, INT4_GROUP_SIZES))} (default {INT4_GROUP_SIZE})."
            )
        return cls(group_size)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, FusedMoE):
            return Int4FusedMoEMethod(prefix, self.group_size)
        return Int4LinearMethod(prefix, self.group_size) if isinstance(layer, LinearBase) else None


def store_int4(layer: nn.Module, prefix: str, group_size: int) -> None:
    """Quantize ``layer.weight`` [out, in] (float) into its int4 form, groups of
    ``int4_group_size(in, prefix, group_size)`` (``store_grouped``).

    Raises:
        ValueError: the input size is not whole groups (names ``prefix``).
    """
    group = int4_group_size(layer.weight.shape[1], prefix, group_size)
    store_grouped(layer, *quantize_int4_per_group(layer.weight.data, group), bits=4)


class Int4LinearMethod(UnquantizedLinearMethod):
    """Loads W like the unquantized method, then keeps only its int4 form (``store_grouped``)
    in groups of ``group_size`` inputs (32 where the layer's inputs are not whole groups)."""

    def __init__(self, prefix: str, group_size: int = INT4_GROUP_SIZE) -> None:
        self.prefix = prefix
        self.group_size = group_size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize the loaded weight (see the module docstring); a second call changes nothing.

        Raises:
            ValueError: the layer's input size is not whole groups (``int4_group_size``, named).
        """
        if hasattr(layer, "weight_zero_point"):
            return
        store_int4(layer, self.prefix, self.group_size)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_grouped(layer, x, bias)

    def describe_path(self, layer: nn.Module) -> str:
        return describe_grouped(layer, "int4")


class Int4FusedMoEMethod(UnquantizedFusedMoEMethod):
    """Loads the experts like the unquantized method, then keeps each expert's W13 [2 x I, H]
    and W2 [H, I] only in int4 form (``store_int4`` on each of ``split_experts``' matrices:
    groups of ``group_size`` inputs, 32 where a matrix's inputs are not whole groups)."""

    def __init__(self, prefix: str, group_size: int = INT4_GROUP_SIZE) -> None:
        self.prefix = prefix
        self.group_size = group_size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize the loaded experts; a second call changes nothing.

        Raises:
            ValueError: H or I is not whole groups of 32 (``int4_group_size``, named).
        """
        split_experts(layer, lambda matrix: store_int4(matrix, self.prefix, self.group_size))

    def describe_path(self, layer: nn.Module) -> str:
        if not len(layer.w13_experts):
            return "experts: int4"
        w13, w2 = (describe_grouped(m[0], "int4") for m in (layer.w13_experts, layer.w2_experts))
        return f"experts: {w13}" if w13 == w2 else f"experts: W13 {w13}; W2 {w2}"
