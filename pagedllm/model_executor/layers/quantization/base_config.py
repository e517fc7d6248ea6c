"""The quantization seam: a ``QuantizationConfig`` picks, per layer, the
``QuantizeMethodBase`` that creates, prepares and multiplies that layer's weights.

The shape is vLLM's: a layer asks ``quant_config.get_quant_method(self, prefix)`` in its
``__init__``, calls the method's ``create_weights`` to register its parameters (each with a
``weight_loader``), the model loader calls ``process_weights_after_loading`` once the
checkpoint is in, and the layer's ``forward`` is the method's ``apply``. A quantized format
(gptq, awq, fp8 ...) is a new config and method here; the model does not change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
from torch import nn


class QuantizeMethodBase(ABC):
    """How one layer stores and applies its weights."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, *weight_args: Any, **extra_weight_attrs: Any) -> None:
        """Register the layer's parameters (with a ``weight_loader`` attribute each) on ``layer``."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer's output for input ``x`` (see the method's own docstring for shapes)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Prepare the loaded weights for ``apply`` (re-layout, scales ...); by default nothing."""

    def describe_path(self, layer: nn.Module) -> str:
        """How ``apply`` computes on this machine, for the start-up log; by default the method's name."""
        return type(self).__name__


class QuantizationConfig(ABC):
    """A weight format, as config.json's ``quantization_config`` describes it."""

    #: For a format that quantizes at load (``--quantization int4`` ...): the keys of
    #: ``--quantization-config`` (vLLM's ``quantization_config`` engine argument) it reads; its
    #: ``from_config`` gets that dict. The loader refuses any other key.
    online_config_keys: tuple[str, ...] = ()

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The format's name, as ``quantization_config["quant_method"]`` spells it."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantizationConfig":
        """The config from config.json's ``quantization_config`` dict.

        Raises:
            ValueError: for settings this format does not support.
        """

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        """The method for ``layer`` (named ``prefix`` in the model, e.g.
        ``model.layers.0.self_attn.qkv_proj``), or None to leave it unquantized (the layer's
        own default method)."""
