"""Weight formats by name: ``get_quantization_config("unquantized")`` -> its config class.

Only "unquantized" exists today; gptq, awq, fp8 ... register here.
"""

from __future__ import annotations

from typing import Optional

from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.layers.quantization.unquantized import UnquantizedConfig

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    UnquantizedConfig.get_name(): UnquantizedConfig,
}


def get_quantization_config(name: Optional[str]) -> type[QuantizationConfig]:
    """The config class of the format ``name`` (None: "unquantized").

    Raises:
        ValueError: for an unknown name; the message lists the supported ones.
    """
    key = "unquantized" if name is None else name
    try:
        return QUANTIZATION_METHODS[key]
    except KeyError:
        raise ValueError(
            f"Quantization method {key!r} is not supported. Supported: {', '.join(sorted(QUANTIZATION_METHODS))}."
        ) from None


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase", "get_quantization_config"]
