"""Weight formats by name: ``get_quantization_config("unquantized")`` -> its config class.

"unquantized"; the load-time formats "int8", "int4" and "fp8"; the checkpoint formats "gptq",
"awq", "compressed-tensors" and "gguf" (their integer weights share ``packed_int``), "fp8", and
"mxfp4" (gpt-oss's experts, dequantized at load).
"""

from __future__ import annotations

import importlib
from typing import Optional, Union

from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.layers.quantization.unquantized import UnquantizedConfig

#: Format name -> its config class, or "module:ConfigClass" under this package (imported on use).
QUANTIZATION_METHODS: dict[str, Union[str, type[QuantizationConfig]]] = {
    UnquantizedConfig.get_name(): "unquantized:UnquantizedConfig",
    "int8": "int8:Int8Config",
    "int4": "int4:Int4Config",
    "gptq": "gptq:GPTQConfig",
    "awq": "awq:AWQConfig",
    "compressed-tensors": "compressed_tensors:CompressedTensorsConfig",
    "gguf": "gguf:GGUFConfig",
    "fp8": "fp8:Fp8Config",
    "mxfp4": "mxfp4:Mxfp4Config",
}


#: The formats that quantize a 16/32-bit checkpoint at load (``--quantization NAME``); the
#: others read a checkpoint already in their format.
ONLINE_QUANTIZATION_METHODS = ("int8", "int4", "fp8")


def get_quantization_config(name: Optional[str]) -> type[QuantizationConfig]:
    """The config class of the format ``name`` (None: "unquantized").

    Raises:
        ValueError: for an unknown name; the message lists the supported ones.
    """
    key = "unquantized" if name is None else name
    try:
        entry = QUANTIZATION_METHODS[key]
    except KeyError:
        raise ValueError(
            f"Quantization method {key!r} is not supported yet. Supported: {', '.join(sorted(QUANTIZATION_METHODS))}."
        ) from None
    if isinstance(entry, str):
        module_name, class_name = entry.split(":")
        entry = getattr(importlib.import_module(f"{__name__}.{module_name}"), class_name)
    return entry


__all__ = ["ONLINE_QUANTIZATION_METHODS", "QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase", "get_quantization_config"]
