"""GPTQ checkpoints (``quant_method: "gptq"``), as AutoGPTQ and GPTQModel write them
(Frantar et al. 2022, arXiv:2210.17323): per linear module ``qweight`` [in * bits / 32, out]
int32 (inputs packed, value i of a word at bits [i * bits, (i + 1) * bits)), ``qzeros``
[groups, out * bits / 32] int32 (outputs packed likewise), ``scales`` [groups, out] float16
and ``g_idx`` [in] int32 (each input's group; not monotonic with ``desc_act``), so that

    W[n, k] = scales[g, n] * (q[k, n] - z[g, n]),   g = g_idx[k],

where the stored zero is z - 1 in the original format (``checkpoint_format: "gptq"``) and z
itself in ``"gptq_v2"``. 4- and 8-bit, ``group_size`` -1 / 32 / 64 / 128, ``sym`` true or false,
``desc_act`` (act-order: inputs are permuted into contiguous groups at load, and each input
row of x gathered alike at run time). The lm_head stays unquantized, as GPTQ leaves it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import LinearBase
from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.layers.quantization.packed_int import (
    PackedIntLinearMethod,
    check_bits_and_group,
    per_output_tensors,
    unpack_int32,
)


class GPTQConfig(QuantizationConfig):
    """config.json's GPTQ ``quantization_config``: ``bits``, ``group_size``,
    ``checkpoint_format`` (``sym`` and ``desc_act`` need nothing: the zero points and ``g_idx``
    say it all).

    Raises (``from_config``):
        ValueError: a bit width, group size or checkpoint format not supported (named).
    """

    def __init__(self, bits: int, group_size: int, zero_offset: int) -> None:
        self.bits = bits
        self.group_size = group_size
        self.zero_offset = zero_offset

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GPTQConfig":
        bits, group_size = int(config.get("bits", 4)), int(config.get("group_size", 128))
        check_bits_and_group("gptq", bits, group_size)
        checkpoint_format = config.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint_format {checkpoint_format!r} is not supported; supported: gptq, gptq_v2.")
        # desc_act needs nothing here: g_idx says each input's group either way.
        return cls(bits, group_size, 1 if checkpoint_format == "gptq" else 0)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        return GPTQLinearMethod(self, prefix) if isinstance(layer, LinearBase) else None


class GPTQLinearMethod(PackedIntLinearMethod):
    """One GPTQ layer: converts ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx`` to the
    canonical layout (see ``packed_int``)."""

    format_name = "gptq"

    def __init__(self, config: GPTQConfig, prefix: str) -> None:
        super().__init__(prefix, config.bits, config.group_size)
        self.zero_offset = config.zero_offset
        self._g_idx: Optional[torch.Tensor] = None  # the first fused part's, while loading

    def checkpoint_tensors(self, num_groups: int, input_size: int) -> dict[str, tuple[list[int], dict[str, Any]]]:
        tensors = per_output_tensors(("qweight", "scales", "qzeros"), num_groups, input_size)
        return {**tensors, "g_idx": ([input_size], {"input_dim": 0})}

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "g_idx":
            # The fused parts of a layer (q/k/v, gate/up) share one g_idx parameter; act-order
            # gives modules of one input the same order, and anything else cannot be fused.
            if self._g_idx is not None and not torch.equal(self._g_idx, tensor):
                raise ValueError("the act-order groups differ from the other fused parts' (they must be equal).")
            self._g_idx = tensor
            return tensor
        if name == "qweight":
            return unpack_int32(tensor, self.bits, dim=0).T
        if name == "qzeros":
            return unpack_int32(tensor, self.bits, dim=1).T.float() + self.zero_offset
        return tensor.T.float()
