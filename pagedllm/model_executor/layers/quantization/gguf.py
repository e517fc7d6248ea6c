"""GGUF files' quantized weights (``pagedllm serve model.gguf``): linear layers whose every
checkpoint part is Q4_0 or Q4_1 take 4-bit weights in groups of 32 inputs, already converted
to ``packed_int``'s canonical layout by ``pagedllm.model_executor.gguf_weights``; every other
layer gets float weights (dequantized at load where the file's type has no kernel yet).
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
    """``{"int4_modules": [checkpoint module names]}``: the linear modules the file holds in
    Q4_0 / Q4_1 (the model loader reads them from the file's header)."""

    def __init__(self, int4_modules: set[str]) -> None:
        self.int4_modules = int4_modules

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GGUFConfig":
        return cls(set(config.get("int4_modules", ())))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if not isinstance(layer, LinearBase):
            return None
        parts = checkpoint_module_names(prefix)
        return GGUFInt4LinearMethod(prefix) if all(part in self.int4_modules for part in parts) else None


class GGUFInt4LinearMethod(PackedIntLinearMethod):
    """A layer of Q4_0 / Q4_1 blocks, received already in the canonical layout."""

    format_name = "gguf"

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix, bits=4, group_size=32)

    def checkpoint_tensors(self, num_groups: int, input_size: int) -> dict[str, tuple[list[int], dict[str, Any]]]:
        return per_output_tensors(("qweight", "scales", "qzeros"), num_groups, input_size)

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor
