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
``FusedMoE`` experts (``GPTQFusedMoEMethod``): the same tensors per expert matrix
(``experts.<e>.w1.qweight`` ...), without act-order for now.
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
        if isinstance(layer, FusedMoE):
            return GPTQFusedMoEMethod(self, prefix)
        return GPTQLinearMethod(self, prefix) if isinstance(layer, LinearBase) else None


def convert_gptq(name: str, tensor: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    """A GPTQ module's ``qweight`` / ``qzeros`` / ``scales`` -> the canonical layout (see
    ``packed_int``): unpacked, [out, ...], zero points plus ``zero_offset``."""
    if name == "qweight":
        return unpack_int32(tensor, bits, dim=0).T
    if name == "qzeros":
        return unpack_int32(tensor, bits, dim=1).T.float() + zero_offset
    return tensor.T.float()


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
        return convert_gptq(name, tensor, self.bits, self.zero_offset)


class GPTQFusedMoEMethod(PackedIntFusedMoEMethod):
    """``FusedMoE`` experts of a GPTQ checkpoint (``experts.<e>.<projection>.qweight`` /
    ``qzeros`` / ``scales`` / ``g_idx`` per expert matrix, as for a linear module), W13 and W2
    in the config's bits and groups. ``g_idx`` is read and checked: act-order experts (inputs
    not in their groups' order) are refused at load.

    Raises (when loading):
        ValueError: a malformed tensor, or an act-order ``g_idx`` (names the tensor).
    """

    format_name = "gptq"

    def __init__(self, config: GPTQConfig, prefix: str) -> None:
        super().__init__(prefix, (config.bits, config.group_size), (config.bits, config.group_size))
        self.bits, self.group_size, self.zero_offset = config.bits, config.group_size, config.zero_offset

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return convert_gptq(name, tensor, self.bits, self.zero_offset)

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
        params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs)  # fmt: skip
        inputs = {"w13": hidden_size, "w2": intermediate_size_per_partition * layer.moe_tp_size}

        def check(g_idx: torch.Tensor, shard_id: str, matrix: str) -> Optional[str]:
            size = inputs[matrix]
            expected = torch.arange(size) // (size if self.group_size == -1 else self.group_size)
            if torch.equal(g_idx.reshape(-1).long(), expected):
                return None
            return (f"act-order (desc_act) groups are not supported for experts yet; expected {size} inputs in "
                    "their groups' order.")

        for matrix in inputs:
            self.register_checked(layer, f"{matrix}_g_idx", check)
