"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``), the format
llm-compressor writes: ``config_groups`` of schemes, each with ``targets`` (module class names
such as ``Linear``, names, or ``re:`` patterns) and ``weights`` arguments, plus ``ignore``d
modules (the lm_head, typically). Built here: weight-only integer schemes in the
``pack-quantized`` format (W4A16, W8A16), per group or per channel, symmetric or not, with
``actorder: "group"``'s ``weight_g_idx``, and the 8-bit ``int-quantized`` / ``float-quantized``
schemes (W8A8 int8, FP8; ``compressed_tensors_w8a8``). Pack-quantized, per linear module:

    weight_packed [out, in * bits / 32] int32   inputs packed, value i at bits [i * bits, ...),
                                                stored as q + 2^(bits - 1) (q signed)
    weight_scale [out, groups]                  (groups = 1 per channel)
    weight_zero_point [out * bits / 32, groups] int32, outputs packed likewise (asymmetric only)
    weight_shape [2]                            the unpacked [out, in]

    W[n, k] = weight_scale[n, g] * (q[n, k] - zero_point[n, g])

(compressed-tensors' ``PackedQuantizationCompressor``). Other formats, and pack-quantized
groups that quantize activations, are refused at load, named. ``FusedMoE`` experts
(``CompressedTensorsFusedMoEMethod``): the same tensors per expert matrix, pack-quantized
without act-order.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.linear import LinearBase
from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.layers.quantization.compressed_tensors_w8a8 import W8A8_FORMATS, W8A8Scheme
from pagedllm.model_executor.layers.quantization.packed_int import (
    PackedIntFusedMoEMethod,
    PackedIntLinearMethod,
    check_bits_and_group,
    checkpoint_module_names,
    name_matches,
    per_output_tensors,
    unpack_int32,
)

#: The canonical role of each checkpoint tensor name (see ``packed_int``).
_CANONICAL = {"weight_packed": "qweight", "weight_scale": "scales", "weight_zero_point": "qzeros", "weight_g_idx": "g_idx"}


class WeightScheme:
    """One config group's weight arguments: ``bits``, ``group_size`` (-1 per channel),
    ``symmetric``, ``actorder`` ("group" adds ``weight_g_idx``), and its ``targets``."""

    def __init__(self, targets: list[str], bits: int, group_size: int, symmetric: bool, actorder: bool) -> None:
        self.targets = targets
        self.bits = bits
        self.group_size = group_size
        self.symmetric = symmetric
        self.actorder = actorder

    @classmethod
    def from_group(cls, name: str, group: dict[str, Any]) -> "WeightScheme":
        """Parse config group ``name``.

        Raises:
            ValueError: activation quantization, float weights, a strategy, bit width or group
                size not supported (the message names the group and what is supported).
        """
        weights = group.get("weights") or {}
        supported = "supported: weight-only int schemes (W4A16, W8A16) per group or per channel"
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"compressed-tensors: config group {name!r} quantizes activations; {supported}.")
        if weights.get("type", "int") != "int":
            raise ValueError(f"compressed-tensors: config group {name!r} has {weights.get('type')} weights; {supported}.")
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors: config group {name!r} uses strategy {strategy!r}; {supported}.")
        bits = int(weights.get("num_bits", 8))
        group_size = int(weights.get("group_size") or 128) if strategy == "group" else -1
        check_bits_and_group(f"compressed-tensors group {name!r}", bits, group_size)
        actorder = weights.get("actorder") in ("group", True)
        return cls(list(group.get("targets") or []), bits, group_size, bool(weights.get("symmetric", True)), actorder)

    def quant_method(self, prefix: str) -> "CompressedTensorsLinearMethod":
        return CompressedTensorsLinearMethod(self, prefix)


def targets_match(targets: list[str], module_name: str) -> bool:
    """Whether a config group's ``targets`` select checkpoint module ``module_name`` (every
    linear layer here is a ``Linear``)."""
    return any(target == "Linear" or name_matches(module_name, target) for target in targets)


class CompressedTensorsConfig(QuantizationConfig):
    """config.json's compressed-tensors ``quantization_config``: ``format``, ``config_groups``,
    ``ignore``.

    Raises (``from_config``):
        ValueError: a format other than pack-quantized and ``W8A8_FORMATS``, or an
            unsupported scheme (named).
    """

    def __init__(self, schemes: list[Union[WeightScheme, W8A8Scheme]], ignore: list[str]) -> None:
        self.schemes = schemes
        self.ignore = ignore

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompressedTensorsConfig":
        schemes = []
        for name, group in (config.get("config_groups") or {}).items():
            fmt = group.get("format") or config.get("format")
            if fmt == "pack-quantized":
                schemes.append(WeightScheme.from_group(name, group))
            elif fmt in W8A8_FORMATS:
                schemes.append(W8A8Scheme.from_group(name, group))
            else:
                raise ValueError(
                    f"compressed-tensors: format {fmt!r} (config group {name!r}) is not supported; "
                    f"supported: pack-quantized, {', '.join(W8A8_FORMATS)}."
                )
        return cls(schemes, list(config.get("ignore") or []))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        """The layer's scheme, found from its checkpoint modules (all parts of a fused layer).

        Raises:
            ValueError: the parts of a fused layer are quantized differently.
        """
        if isinstance(layer, FusedMoE):
            return self._experts_method(prefix)
        if not isinstance(layer, LinearBase):
            return None
        found = set()
        for name in checkpoint_module_names(prefix):
            ignored = any(name_matches(name, pattern) for pattern in self.ignore)
            found.add(None if ignored else next((s for s in self.schemes if targets_match(s.targets, name)), None))
        if len(found) > 1:
            raise ValueError(f"compressed-tensors: the parts of fused layer {prefix} are quantized differently.")
        scheme = found.pop()
        return None if scheme is None else scheme.quant_method(prefix)


    def _experts_method(self, prefix: str) -> Optional[QuantizeMethodBase]:
        """The experts' method, from the scheme of their first matrix (``<prefix>.0.gate_proj``;
        experts are ``Linear`` modules in the checkpoint): None where ignored or untargeted.

        Raises:
            ValueError: a scheme other than pack-quantized or with act-order, for experts (named).
        """
        name = f"{prefix}.0.gate_proj"
        if any(name_matches(name, pattern) for pattern in self.ignore):
            return None
        scheme = next((s for s in self.schemes if targets_match(s.targets, name)), None)
        if scheme is None:
            return None
        if not isinstance(scheme, WeightScheme) or scheme.actorder:
            raise ValueError(f"compressed-tensors: the experts {prefix} can be read as pack-quantized weights "
                             "without act-order only, for now.")
        return CompressedTensorsFusedMoEMethod(scheme, prefix)


class CompressedTensorsLinearMethod(PackedIntLinearMethod):
    """One pack-quantized layer: converts its tensors to the canonical layout (see ``packed_int``)."""

    format_name = "compressed-tensors"

    def __init__(self, scheme: WeightScheme, prefix: str) -> None:
        super().__init__(prefix, scheme.bits, scheme.group_size)
        self.scheme = scheme

    def canonical_name(self, name: str) -> str:
        return _CANONICAL.get(name, name)

    def checkpoint_tensors(self, num_groups: int, input_size: int) -> dict[str, tuple[list[int], dict[str, Any]]]:
        tensors = per_output_tensors(("weight_packed", "weight_scale", "weight_zero_point"), num_groups, input_size)
        tensors["weight_shape"] = ([2], {})
        if self.scheme.symmetric:
            del tensors["weight_zero_point"]
        if self.scheme.actorder:
            tensors["weight_g_idx"] = ([input_size], {"input_dim": 0})
        return tensors

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # Packed values are stored unsigned (q + 2^(bits - 1)), zero points too, so the
        # unpacked zero point is already the canonical unsigned one.
        if name == "weight_packed":
            return unpack_int32(tensor, self.bits, dim=1)
        if name == "weight_zero_point":
            return unpack_int32(tensor, self.bits, dim=0).float()
        return tensor if name == "weight_g_idx" else tensor.float()


class CompressedTensorsFusedMoEMethod(PackedIntFusedMoEMethod):
    """``FusedMoE`` experts of a pack-quantized checkpoint (``experts.<e>.<projection>.``
    ``weight_packed`` / ``weight_scale`` / ``weight_zero_point`` (asymmetric) / ``weight_shape``
    per expert matrix, as for a linear module), W13 and W2 in the scheme's bits and groups;
    ``weight_shape`` is checked against the matrix's [rows, inputs]."""

    format_name = "compressed-tensors"
    names = {"qweight": "weight_packed", "scales": "weight_scale", "qzeros": "weight_zero_point"}

    def __init__(self, scheme: WeightScheme, prefix: str) -> None:
        layout = (scheme.bits, scheme.group_size)
        super().__init__(prefix, layout, layout, symmetric=scheme.symmetric)
        self.bits = scheme.bits

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "qweight":
            return unpack_int32(tensor, self.bits, dim=1)
        if name == "qzeros":
            return unpack_int32(tensor, self.bits, dim=0).float()
        return tensor.float()

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
        params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs)  # fmt: skip
        inter = intermediate_size_per_partition * layer.moe_tp_size
        shapes = {"w13": [inter, hidden_size], "w2": [hidden_size, inter]}

        def check(shape: torch.Tensor, shard_id: str, matrix: str) -> Optional[str]:
            got = [int(v) for v in shape.reshape(-1)]
            return None if got == shapes[matrix] else f"weight_shape {got}; the experts' matrix is {shapes[matrix]}."

        for matrix in shapes:
            self.register_checked(layer, f"{matrix}_weight_shape", check)
