"""What the integer checkpoint formats (GPTQ, AWQ, compressed-tensors' pack-quantized) have in
common: sub-byte integers packed into int32 words, and weights W = scale * (Q - zero) with one
scale and zero point per group of inputs.

Each format's method registers, per layer, parameters in one canonical unpacked layout:
``qweight`` Q [out, in] uint8 (unsigned, 0 to 2^bits - 1), ``scales`` [out, in / group]
float32, ``qzeros`` [out, in / group] float32 (the unsigned zero point), and optionally
``g_idx`` [in] (GPTQ's act-order groups), each with a ``weight_loader`` that converts the
checkpoint tensor of that name (``convert``) before the layer's own loader slices and stacks
it (tensor parallelism and fused q/k/v, gate/up work unchanged). Once loaded,
``process_weights_after_loading`` hands symmetric per-channel 8-bit weights to ``linear_w8``
(signed int8, one scale per output) and every other layout to ``linear_w4`` / ``linear_w8g``
(``grouped.py``). ``FusedMoE`` experts (``PackedIntFusedMoEMethod``) hold the same canonical
tensors per expert matrix and hand each matrix to the same kernels.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from typing import Any, Callable, Optional

import torch
from torch import nn

from pagedllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
from pagedllm.model_executor.layers.fused_moe.methods import drop_checked, register_checked, split_experts
from pagedllm.model_executor.layers.linear import LinearMethodBase
from pagedllm.model_executor.layers.quantization.grouped import apply_grouped, describe_grouped, store_grouped
from pagedllm.model_executor.layers.quantization.int8 import apply_int8, describe_int8, store_int8
from pagedllm.model_executor.utils import set_weight_attrs


#: Checkpoint module names of our fused layers (``qkv_proj`` holds q_proj, k_proj, v_proj).
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_module_names(prefix: str) -> list[str]:
    """The checkpoint module names a layer named ``prefix`` loads: its parts for a fused
    layer (``model.layers.0.self_attn.qkv_proj`` -> ``...q_proj``, ``...k_proj``,
    ``...v_proj``), else ``[prefix]``."""
    head, _, last = prefix.rpartition(".")
    parts = FUSED_MODULES.get(last)
    if parts is None:
        return [prefix]
    return [f"{head}.{part}" if head else part for part in parts]


def name_matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches an ``ignore`` / ``targets`` entry of a quantization
    config: ``re:<regex>`` (``re.match``, as compressed-tensors and vLLM read it), or an exact
    name, or a name's suffix after a dot."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Optional[list[int]] = None) -> torch.Tensor:
    """Split each int32 of ``packed`` into 32 / ``bits`` unsigned values along ``dim`` (0 or
    1): value i of a word sits at bits [i * bits, (i + 1) * bits), and becomes element
    ``order[i]`` of the word's run (default: i). Returns uint8 (bits <= 8), the packed
    dimension 32 / bits times longer.

    Raises:
        ValueError: ``packed`` not int32 2-D, or bits not 4 or 8.
    """
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"expected a 2-D int32 tensor of packed {bits}-bit values, got {packed.dtype} {tuple(packed.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit packing is not supported; supported: 4, 8")
    per_word = 32 // bits
    words = packed if dim == 1 else packed.T
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        values = values[..., torch.tensor(order).argsort()]
    values = values.reshape(words.shape[0], words.shape[1] * per_word).to(torch.uint8)
    return values if dim == 1 else values.T.contiguous()


#: Group sizes the packed formats may use (-1: one group per output row).
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)


def check_bits_and_group(format_name: str, bits: int, group_size: int, supported_bits: tuple[int, ...] = (4, 8)) -> None:
    """Refuse a bit width or group size the packed formats do not support here.

    Raises:
        ValueError: naming the format, the value, and the supported values.
    """
    if bits not in supported_bits:
        raise ValueError(f"{format_name}: {bits}-bit weights are not supported; supported: {supported_bits}.")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{format_name}: group_size {group_size} is not supported; supported: {SUPPORTED_GROUP_SIZES}.")


def per_output_tensors(names: tuple[str, ...], num_groups: int, input_size: int) -> dict[str, tuple[list[int], dict[str, Any]]]:
    """``checkpoint_tensors``' entries for the usual three: ``names`` of the weight, the
    scales and the zero points, in the canonical [out, in] / [out, groups] layout."""
    per_output = {"output_dim": 0, "input_dim": 1}
    weight, scales, zeros = names
    return {weight: ([-1, input_size], per_output), scales: ([-1, num_groups], per_output),
            zeros: ([-1, num_groups], per_output)}  # fmt: skip


def store_canonical(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> None:
    """Hand canonical weights (Q [out, in] uint8, scale / zero [out, groups] float32) to their
    kernel: symmetric per-channel 8-bit ones to ``store_int8`` (signed int8, one scale per
    output), every other layout to ``store_grouped``."""
    if bits == 8 and scale.shape[1] == 1 and bool((zero == 128).all()):
        store_int8(layer, (q.to(torch.int16) - 128).to(torch.int8), scale[:, 0])
    else:
        store_grouped(layer, q, scale, zero, bits)


def describe_canonical(layer: nn.Module, format_name: str) -> str:
    """The start-up log's name of a ``store_canonical`` layer's matmul path."""
    if hasattr(layer, "weight_zero_point"):
        return describe_grouped(layer, format_name)
    return f"{format_name}: " + describe_int8(layer)


class PackedIntLinearMethod(LinearMethodBase):
    """A layer whose checkpoint holds ``bits``-bit integer weights in groups of
    ``group_size`` inputs (-1: one group per output row). Subclasses name the checkpoint
    tensors and convert them (``checkpoint_tensors``, ``convert``).

    Args:
        prefix: the layer's name (for errors).
        bits: 4 or 8.
        group_size: inputs per scale, or -1 for one per output row.
    """

    def __init__(self, prefix: str, bits: int, group_size: int) -> None:
        self.prefix = prefix
        self.bits = bits
        self.group_size = group_size

    @property
    @abstractmethod
    def format_name(self) -> str:
        """The format, for logs and errors ("gptq", "awq" ...)."""

    @abstractmethod
    def checkpoint_tensors(self, num_groups: int, input_size: int) -> dict[str, tuple[list[int], dict[str, Any]]]:
        """Checkpoint tensor name -> ([shape in the canonical layout, as ``[out, in]``-style
        dims with -1 for the layer's outputs], loader attributes: ``output_dim`` /
        ``input_dim`` of that layout). Must include ``qweight`` and ``scales`` (or the
        format's names for them, mapped by ``canonical_name``); without ``qzeros`` the zero
        point is 2^(bits - 1) (symmetric)."""

    @abstractmethod
    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor -> the canonical layout of parameter ``name`` (see the module
        docstring).

        Raises:
            ValueError: a tensor of the wrong dtype or a shape that cannot be unpacked.
        """

    def canonical_name(self, name: str) -> str:
        """The canonical role of checkpoint tensor ``name``: qweight, scales, qzeros, g_idx, or
        another name the method keeps for itself."""
        return name

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        group = input_size_per_partition if self.group_size == -1 else self.group_size
        if input_size_per_partition % group:
            raise ValueError(
                f"{self.format_name}: layer {self.prefix} has {input_size_per_partition} inputs, not a multiple "
                f"of the group size {group}."
            )
        layer_loader: Callable[..., None] = extra_weight_attrs.pop("weight_loader")
        out = sum(output_partition_sizes)
        dtypes = {"qweight": torch.uint8, "g_idx": torch.int32}
        for name, (shape, attrs) in self.checkpoint_tensors(input_size_per_partition // group, input_size_per_partition).items():
            dtype = dtypes.get(self.canonical_name(name), torch.float32)
            param = nn.Parameter(torch.empty([out if d == -1 else d for d in shape], dtype=dtype), requires_grad=False)
            set_weight_attrs(param, {**attrs, **extra_weight_attrs, "weight_loader": self._loader(name, layer_loader)})
            layer.register_parameter(name, param)

    def _loader(self, name: str, layer_loader: Callable[..., None]) -> Callable[..., None]:
        def load(param: nn.Parameter, loaded_weight: torch.Tensor, *shard_id: Any) -> None:
            try:
                layer_loader(param, self.convert(name, loaded_weight), *shard_id)
            except ValueError as exc:
                part = f" (part {shard_id[0]!r})" if shard_id else ""
                raise ValueError(
                    f"{self.format_name}: layer {self.prefix}{part}, tensor {name!r}: {exc} "
                    f"Expected {self.bits}-bit weights in groups of {self.group_size}."
                ) from None

        return load

    def _canonical(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        return {self.canonical_name(name): param.data for name, param in layer.named_parameters(recurse=False)}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Hand the loaded weights to their kernel (see the module docstring), dropping the
        checkpoint-layout parameters; a second call changes nothing."""
        if hasattr(layer, "weight"):
            return
        tensors = self._canonical(layer)
        q, scale, g_idx = tensors["qweight"], tensors["scales"], tensors.get("g_idx")
        zero = tensors.get("qzeros", torch.full_like(scale, 2 ** (self.bits - 1)))  # symmetric: mid-range
        for name, _ in list(layer.named_parameters(recurse=False)):
            if name != "bias":
                delattr(layer, name)
        layer.input_perm = None
        if g_idx is not None:
            perm = torch.argsort(g_idx.long(), stable=True)
            if not torch.equal(perm, torch.arange(perm.numel(), device=perm.device)):
                q, layer.input_perm = q[:, perm].contiguous(), perm
        store_canonical(layer, q, scale, zero, self.bits)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if layer.input_perm is not None:
            x = x.index_select(-1, layer.input_perm)
        if hasattr(layer, "weight_zero_point"):
            return apply_grouped(layer, x, bias)
        return apply_int8(layer, x, bias)

    def describe_path(self, layer: nn.Module) -> str:
        return describe_canonical(layer, self.format_name)


#: (bits, inputs per group; -1: one group per output row) of an expert matrix.
Layout = tuple[int, int]


class PackedIntFusedMoEMethod(UnquantizedFusedMoEMethod):
    """``FusedMoE`` experts whose checkpoint holds integer weights, per expert matrix in the
    canonical layout (see the module docstring), as parameters named by the format's tensors
    (``names``: canonical role -> checkpoint name): ``w13_<qweight>`` [E, 2 x I, H] uint8,
    ``w13_<scales>`` / ``w13_<qzeros>`` [E, 2 x I, H / group] float32 ([gate | up] rows; up
    alone when ungated), ``w2_<...>`` [E, H, I] / [E, H, I / group], each loaded through the
    layer's ``weight_loader`` after ``convert``; no zero points when ``symmetric`` (2^(bits -
    1)). A format's tensors that are only checked (GPTQ's ``g_idx``) are empty parameters with
    their own loader (``fused_moe.methods.register_checked``). Once loaded, every expert
    matrix goes to its kernel as a linear layer's would (``store_canonical`` on ``split_experts``' matrices).
    Subclasses name the format and convert its tensors.

    Args:
        prefix: the layer's name (for errors).
        w13_layout, w2_layout: (bits 4 or 8, inputs per group; -1 one per row) of W13 and W2.
        symmetric: the checkpoint has no zero points.

    Raises (``create_weights``):
        ValueError: H or I not whole groups (names the layer).
    """

    supports_bias = False
    format_name = "packed-int"
    names = {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros"}

    def __init__(self, prefix: str, w13_layout: Layout, w2_layout: Layout, symmetric: bool = False) -> None:
        self.prefix = prefix
        self.layouts = {"w13": w13_layout, "w2": w2_layout}
        self.roles = ("qweight", "scales") if symmetric else ("qweight", "scales", "qzeros")

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor of one expert matrix (its canonical role ``name``: qweight,
        scales, qzeros) -> the canonical layout; by default the tensor itself."""
        return tensor

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
        params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        inter = intermediate_size_per_partition
        w13_rows = (2 if getattr(layer, "is_act_and_mul", True) else 1) * inter
        layer_loader: Callable[..., None] = extra_weight_attrs.pop("weight_loader")
        for matrix, rows, inputs in (("w13", w13_rows, hidden_size), ("w2", hidden_size, inter)):
            bits, group = self.layouts[matrix]
            group = inputs if group == -1 else group
            if inputs % group:
                raise ValueError(f"{self.format_name}: the experts {self.prefix} have {matrix.upper()} matrices of "
                                 f"{inputs} inputs, not a multiple of the group size {group}.")
            for role in self.roles:
                shape = (num_experts, rows, inputs if role == "qweight" else inputs // group)
                dtype = torch.uint8 if role == "qweight" else torch.float32
                param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
                set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": self._loader(role, layer_loader)})
                layer.register_parameter(f"{matrix}_{self.names[role]}", param)

    def _loader(self, role: str, layer_loader: Callable[..., None]) -> Callable[..., None]:
        def load(param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, shard_id: str,
                 expert_id: int) -> None:
            try:
                converted = self.convert(role, loaded_weight)
            except ValueError as exc:
                raise ValueError(f"{self.format_name}: checkpoint tensor {weight_name!r}: {exc}") from None
            layer_loader(param, converted, weight_name, shard_id, expert_id)

        return load

    def register_checked(self, layer: nn.Module, name: str,
                         check: Callable[[torch.Tensor, str, str], Optional[str]]) -> None:
        """``fused_moe.methods.register_checked`` in this format's name."""
        register_checked(layer, name, check, self.format_name)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Hand each expert matrix to its kernel, dropping the checked-only parameters; a
        second call changes nothing."""
        drop_checked(layer)

        def prepare(matrix: nn.Module, scale: torch.Tensor, zero: Optional[torch.Tensor] = None) -> None:
            bits = self.layouts[matrix.kind][0]
            zero = torch.full_like(scale, 2 ** (bits - 1)) if zero is None else zero
            store_canonical(matrix, matrix.weight.data, scale, zero, bits)

        split_experts(layer, prepare, tuple(self.names[role] for role in self.roles))

    def describe_path(self, layer: nn.Module) -> str:
        if not len(layer.w13_experts):
            return f"experts: {self.format_name}"
        w13, w2 = (describe_canonical(m[0], self.format_name) for m in (layer.w13_experts, layer.w2_experts))
        return f"experts: {w13}" if w13 == w2 else f"experts: W13 {w13}; W2 {w2}"
