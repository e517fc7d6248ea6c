"""AWQ checkpoints (``quant_method: "awq"``, the GEMM layout AutoAWQ writes; Lin et al. 2023,
arXiv:2306.00978): per linear module ``qweight`` [in, out / 8] int32 and ``qzeros``
[groups, out / 8] int32, outputs packed eight to a word in AWQ's interleaved order (nibble i
holds output ``AWQ_ORDER[i]`` of the word's eight), and ``scales`` [groups, out] float16:

    W[n, k] = scales[g, n] * (q[k, n] - z[g, n]),   g = k / group_size.

4-bit, ``group_size`` (``q_group_size``) 32 / 64 / 128, with zero points (``zero_point``: true,
as AutoAWQ writes). The lm_head stays unquantized. ``FusedMoE`` experts
(``AWQFusedMoEMethod``): the same tensors per expert matrix (``experts.<e>.gate_proj.qweight`` ...).
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

#: Which output of its run of eight each nibble of an AWQ word holds (AutoAWQ's packing order).
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


class AWQConfig(QuantizationConfig):
    """config.json's AWQ ``quantization_config``: ``bits`` / ``w_bit``, ``group_size`` /
    ``q_group_size``, ``zero_point``, ``version``.

    Raises (``from_config``):
        ValueError: a bit width, group size or version not supported (named).
    """

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        bits = int(config.get("bits", config.get("w_bit", 4)))
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        check_bits_and_group("awq", bits, group_size, supported_bits=(4,))
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm" or not config.get("zero_point", True):
            raise ValueError(
                f"awq: version {version!r} with zero_point={config.get('zero_point', True)} is not supported; "
                "supported: the GEMM layout with zero points."
            )
        return cls(group_size)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, FusedMoE):
            return AWQFusedMoEMethod(self, prefix)
        return AWQLinearMethod(self, prefix) if isinstance(layer, LinearBase) else None


def convert_awq(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An AWQ module's ``qweight`` / ``qzeros`` / ``scales`` -> the canonical layout (see
    ``packed_int``): outputs unpacked from AWQ's order, [out, ...]."""
    if name == "qweight":
        return unpack_int32(tensor, 4, dim=1, order=AWQ_ORDER).T
    if name == "qzeros":
        return unpack_int32(tensor, 4, dim=1, order=AWQ_ORDER).T.float()
    return tensor.T.float()


class AWQLinearMethod(PackedIntLinearMethod):
    """One AWQ layer: converts ``qweight`` / ``qzeros`` / ``scales`` to the canonical layout
    (see ``packed_int``)."""

    format_name = "awq"

    def __init__(self, config: AWQConfig, prefix: str) -> None:
        super().__init__(prefix, 4, config.group_size)

    def checkpoint_tensors(self, num_groups: int, input_size: int) -> dict[str, tuple[list[int], dict[str, Any]]]:
        return per_output_tensors(("qweight", "scales", "qzeros"), num_groups, input_size)

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return convert_awq(name, tensor)


class AWQFusedMoEMethod(PackedIntFusedMoEMethod):
    """``FusedMoE`` experts of an AWQ checkpoint (``experts.<e>.<projection>.qweight`` /
    ``qzeros`` / ``scales`` per expert matrix, as for a linear module), 4-bit in the config's
    groups."""

    format_name = "awq"

    def __init__(self, config: AWQConfig, prefix: str) -> None:
        super().__init__(prefix, (4, config.group_size), (4, config.group_size))

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return convert_awq(name, tensor)
