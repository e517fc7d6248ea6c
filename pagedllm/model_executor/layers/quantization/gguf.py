"""GGUF files' quantized weights (``pagedllm serve model.gguf``): linear layers whose
checkpoint parts are all in types the kernels run (``gguf_weights.KERNEL_TYPES``: Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) take integer weights, already converted to ``packed_int``'s canonical
layout by ``pagedllm.model_executor.gguf_weights``: 4-bit storage when every part is 4-bit, else
8-bit, in groups of the smallest group of its parts; every other layer gets float weights
(dequantized at load where the file's type has no kernel yet). ``FusedMoE`` experts (the
stacked ``ffn_{gate,up,down}_exps`` tensors, split per expert by the loader) likewise, W13 and
W2 each at its own layout (Q4_K_M files keep ``ffn_down_exps`` in Q6_K).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.linear import LinearBase
from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.layers.quantization.packed_int import (
    PackedIntFusedMoEMethod,
    PackedIntLinearMethod,
    checkpoint_module_names,
    per_output_tensors,
)


class GGUFConfig(QuantizationConfig):
    """``{"module_layouts": {checkpoint module name: [bits, group]}}``: the linear modules the
    file holds in a type the kernels run, with that type's storage bits and inputs per group
    (the model loader reads them from the file's header)."""

    def __init__(self, module_layouts: dict[str, tuple[int, int]]) -> None:
        self.module_layouts = module_layouts
        #: module -> its layer's (bits, group), filled by get_quant_method for the loader.
        self.kernel_modules: dict[str, tuple[int, int]] = {}

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GGUFConfig":
        return cls({name: (int(bits), int(group)) for name, (bits, group) in config.get("module_layouts", {}).items()})

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        """``GGUFLinearMethod`` when every part of the layer has a kernel type: the widest
        bits and the smallest group of its parts (which then join ``kernel_modules``, the
        modules the loader converts), else None. For ``FusedMoE`` experts (named
        ``<prefix>.w1`` / ``.w3`` / ``.w2`` in ``module_layouts``, the stacked
        ``ffn_{gate,up,down}_exps`` tensors), ``GGUFFusedMoEMethod`` when all of them have a
        kernel type, W13 at its gate and up's widest layout, W2 at its own; else None."""
        if isinstance(layer, FusedMoE):
            return self._experts_method(layer, prefix)
        if not isinstance(layer, LinearBase):
            return None
        layout = self._claim(checkpoint_module_names(prefix))
        return None if layout is None else GGUFLinearMethod(prefix, *layout)

    def _claim(self, parts: list[str]) -> Optional[tuple[int, int]]:
        """The widest bits and smallest group of ``parts``' layouts, which then join
        ``kernel_modules``; None (and nothing claimed) if one of them has no kernel type."""
        layouts = [self.module_layouts.get(part) for part in parts]
        if None in layouts:
            return None
        layout = (max(bits for bits, _ in layouts), min(group for _, group in layouts))
        self.kernel_modules.update(dict.fromkeys(parts, layout))
        return layout

    def _experts_method(self, layer: FusedMoE, prefix: str) -> Optional[QuantizeMethodBase]:
        w13 = [f"{prefix}.{shard}" for shard in (("w1", "w3") if layer.is_act_and_mul else ("w1",))]
        if any(part not in self.module_layouts for part in (*w13, f"{prefix}.w2")):
            return None
        return GGUFFusedMoEMethod(prefix, self._claim(w13), self._claim([f"{prefix}.w2"]))


class GGUFLinearMethod(PackedIntLinearMethod):
    """A layer of GGUF blocks, received already in the canonical layout (``bits`` 4 or 8,
    ``group_size`` 16 or 32)."""

    format_name = "gguf"

    def __init__(self, prefix: str, bits: int, group_size: int) -> None:
        super().__init__(prefix, bits=bits, group_size=group_size)

    def checkpoint_tensors(self, num_groups: int, input_size: int) -> dict[str, tuple[list[int], dict[str, Any]]]:
        return per_output_tensors(("qweight", "scales", "qzeros"), num_groups, input_size)

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class GGUFFusedMoEMethod(PackedIntFusedMoEMethod):
    """``FusedMoE`` experts of GGUF blocks, received per expert already in the canonical
    layout (``w13_layout`` / ``w2_layout``: bits 4 or 8, group 16 or 32)."""

    format_name = "gguf"
