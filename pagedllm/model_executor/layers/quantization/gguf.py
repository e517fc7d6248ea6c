"""GGUF files' quantized weights (``pagedllm serve model.gguf``): linear layers whose
checkpoint parts are all 4-bit (Q4_0 / Q4_1) or all Q8_0 take integer weights in groups of 32
inputs, already converted to ``packed_int``'s canonical layout by
``pagedllm.model_executor.gguf_weights``; every other layer gets float weights (dequantized at
load where the file's type has no kernel yet).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import LinearBase
from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.layers.quantization.packed_int import (
    PackedIntLinearMethod,
    checkpoint_module_names,
    per_output_tensors,
)


class GGUFConfig(QuantizationConfig):
    """``{"module_bits": {checkpoint module name: bits}}``: the linear modules the file holds
    in a type the kernels run, and its bits per weight (the model loader reads them from the
    file's header)."""

    def __init__(self, module_bits: dict[str, int]) -> None:
        self.module_bits = module_bits
        self.kernel_modules: set[str] = set()  # filled by get_quant_method

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GGUFConfig":
        return cls(dict(config.get("module_bits", {})))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if not isinstance(layer, LinearBase):
            return None
        """``GGUFLinearMethod`` when every part of the layer has the same kernel type (its
        parts then join ``kernel_modules``, the modules the loader converts), else None."""
        parts = checkpoint_module_names(prefix)
        bits = {self.module_bits.get(part) for part in parts}
        if len(bits) != 1 or None in bits:
            return None
        self.kernel_modules.update(parts)
        return GGUFLinearMethod(prefix, bits.pop())


class GGUFLinearMethod(PackedIntLinearMethod):
    """A layer of Q4_0 / Q4_1 or Q8_0 blocks, received already in the canonical layout."""

    format_name = "gguf"

    def __init__(self, prefix: str, bits: int) -> None:
        super().__init__(prefix, bits=bits, group_size=32)

    def checkpoint_tensors(self, num_groups: int, input_size: int) -> dict[str, tuple[list[int], dict[str, Any]]]:
        return per_output_tensors(("qweight", "scales", "qzeros"), num_groups, input_size)

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor
