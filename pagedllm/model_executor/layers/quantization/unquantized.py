"""The "unquantized" format: weights stored and applied in the model dtype."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase


class UnquantizedConfig(QuantizationConfig):
    """Every layer keeps its own unquantized method (``UnquantizedLinearMethod`` for linear
    layers, ``UnquantizedEmbeddingMethod`` for the lm_head)."""

    @classmethod
    def get_name(cls) -> str:
        return "unquantized"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "UnquantizedConfig":
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        return None
