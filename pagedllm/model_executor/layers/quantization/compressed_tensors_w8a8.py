"""compressed-tensors' 8-bit schemes in the ``int-quantized`` / ``float-quantized`` (and
``naive-quantized``) formats, which store each quantized linear module's weight unpacked:

    weight       [out, in] int8 (type "int") or float8_e4m3fn (type "float")
    weight_scale [out, 1] (strategy "channel") or [1] (strategy "tensor"), float
    input_scale  [1]  only with static activations (``dynamic: false``, strategy "tensor")

    W[n, k] = weight_scale[n] * weight[n, k]          (symmetric weights: no zero point)

(compressed-tensors' ``NaiveQuantizationCompressor``; the W8A8 presets of llm-compressor:
"W8A8" = int8 channel weights with dynamic per-token int8 activations, "FP8_DYNAMIC" = fp8
channel weights with dynamic per-token fp8 activations, "FP8" = fp8 tensor weights with a
static per-tensor fp8 ``input_scale``). The input is quantized as ``activation_quant`` says,
then:

- int8: ``torch._int_mm`` on a CPU with VNNI (oneDNN's int8 GEMM, exact int32 sums), elsewhere a float32
  matmul of the integer values (exact while a row's sum stays below 2^24); then
  y = acc * s_x[m] * weight_scale[n] (+ bias);
- fp8: ``linear_fp8`` (float32 sums of the e4m3 products, exact products) on the fp8
  activations, then times s_x[m] (+ bias).

Weight-only groups (no ``input_activations``) run the int8 / fp8 weight-only kernels
(``linear_w8`` / ``linear_fp8``). A fused layer's parts keep their own weight scales; their
static ``input_scale``s (one per part, all seen by the same input) become one, the largest,
as vLLM does. Under tensor parallelism a row-parallel layer's dynamic scales come from each
rank's slice of the row (as in vLLM), so its output may differ from one process's by the
activation rounding. Refused at load, named: asymmetric weights or activations, weight strategies
other than channel / tensor (block FP8, groups), activation strategies other than token /
tensor, bit widths other than 8, and output activation quantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import LinearMethodBase
from pagedllm.model_executor.layers.quantization.activation_quant import (
    quantize_fp8_activations,
    quantize_int8_activations,
)
from pagedllm.model_executor.layers.quantization.fp8 import (
    apply_fp8,
    fp8_kernel_name,
    per_tensor_scale_loader,
    store_fp8,
)
from pagedllm.model_executor.layers.quantization.int8 import apply_int8, describe_int8, int8_gemm_exact_on_cpu, store_int8
from pagedllm.model_executor.utils import set_weight_attrs

#: The formats of this module (a config group's or the config's ``format``).
W8A8_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")

_WEIGHT_DTYPES = {"int": torch.int8, "float": torch.float8_e4m3fn}


@dataclass(frozen=True)
class ActivationArgs:
    """A config group's ``input_activations``: ``type_name`` ("int" / "float"), ``per_token``
    (strategy "token"; else "tensor") and ``dynamic`` (else a checkpoint ``input_scale``)."""

    type_name: str
    per_token: bool
    dynamic: bool

    @classmethod
    def parse(cls, group_name: str, args: dict[str, Any], weight_type: str, supported: str) -> "ActivationArgs":
        """Read ``args``.

        Raises:
            ValueError: a combination not supported here (the message names the group and
                ``supported``).
        """
        where = f"compressed-tensors: config group {group_name!r}, input_activations"
        strategy = args.get("strategy", "tensor")
        dynamic = args.get("dynamic", False)
        problems = []
        if int(args.get("num_bits", 8)) != 8 or args.get("type", "int") != weight_type:
            problems.append(f"{args.get('num_bits')}-bit {args.get('type')} with {weight_type} weights")
        if not args.get("symmetric", True):
            problems.append("asymmetric (input_zero_point)")
        if strategy not in ("token", "tensor") or dynamic not in (True, False) or (strategy == "token" and not dynamic):
            problems.append(f"strategy {strategy!r} with dynamic={dynamic!r}")
        if problems:
            raise ValueError(f"{where}: {'; '.join(problems)} is not supported; {supported}.")
        return cls(weight_type, strategy == "token", bool(dynamic))

    def describe(self) -> str:
        scale = "dynamic per-token" if self.per_token else ("dynamic per-tensor" if self.dynamic else "static per-tensor")
        return f"{scale} {'int8' if self.type_name == 'int' else 'fp8'} activations"


#: What ``W8A8Scheme`` reads, for errors.
_SUPPORTED = (
    "supported: 8-bit symmetric int or float8 weights per channel or per tensor, with weight-only, "
    "dynamic per-token, or dynamic / static per-tensor symmetric 8-bit activations of the same type"
)


@dataclass(eq=False)
class W8A8Scheme:
    """One config group of 8-bit unpacked weights: its ``targets``, ``weight_type`` ("int" /
    "float"), ``per_channel`` (else one scale per tensor) and ``activations`` (None:
    weight-only)."""

    targets: list[str]
    weight_type: str
    per_channel: bool
    activations: Optional[ActivationArgs]

    @classmethod
    def from_group(cls, name: str, group: dict[str, Any]) -> "W8A8Scheme":
        """Parse config group ``name``.

        Raises:
            ValueError: a setting not supported here (the message names the group, the
                setting and what is supported).
        """
        weights = group.get("weights") or {}
        where = f"compressed-tensors: config group {name!r}"
        weight_type = weights.get("type", "int")
        strategy = weights.get("strategy", "tensor")
        problems = []
        if weight_type not in _WEIGHT_DTYPES or int(weights.get("num_bits", 8)) != 8:
            problems.append(f"{weights.get('num_bits')}-bit {weight_type} weights")
        if not weights.get("symmetric", True):
            problems.append("asymmetric weights (weight_zero_point)")
        if strategy not in ("channel", "tensor"):
            problems.append(f"weights strategy {strategy!r}" + (" (block-wise FP8)" if strategy == "block" else ""))
        if group.get("output_activations"):
            problems.append("output_activations")
        if problems:
            raise ValueError(f"{where}: {'; '.join(problems)} is not supported; {_SUPPORTED}.")
        inputs = group.get("input_activations")
        activations = None if not inputs else ActivationArgs.parse(name, inputs, weight_type, _SUPPORTED)
        return cls(list(group.get("targets") or []), weight_type, strategy == "channel", activations)

    def quant_method(self, prefix: str) -> "CompressedTensorsW8A8LinearMethod":
        return CompressedTensorsW8A8LinearMethod(self, prefix)


def _int_mm(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x_q [M, K] int8 times weight [N, K] int8, transposed -> [M, N] float32 (exact int32 sums)."""
    return torch._int_mm(x_q, weight.T).float()


def _float_int8_mm(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """As ``_int_mm`` with a float32 matmul (exact while |sums| < 2^24)."""
    return x_q.float() @ weight.float().T


class CompressedTensorsW8A8LinearMethod(LinearMethodBase):
    """One layer of a ``W8A8Scheme`` (see the module docstring)."""

    format_name = "compressed-tensors"

    def __init__(self, scheme: W8A8Scheme, prefix: str) -> None:
        self.scheme = scheme
        self.prefix = prefix
        #: int8 x int8 -> float32 matmul: oneDNN's on CPU, float32 elsewhere (fixed at load).
        self.int8_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _float_int8_mm

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        loader: Callable[..., None] = extra_weight_attrs.pop("weight_loader")
        out = sum(output_partition_sizes)
        dtype = _WEIGHT_DTYPES[self.scheme.weight_type]
        weight = nn.Parameter(torch.empty(out, input_size_per_partition, dtype=dtype), requires_grad=False)
        weight_attrs = {"output_dim": 0, "input_dim": 1, **extra_weight_attrs}
        set_weight_attrs(weight, {**weight_attrs, "weight_loader": self._checked(loader, "weight")})
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(torch.empty(out), requires_grad=False)
        if self.scheme.per_channel:
            scale_loader = self._checked(lambda p, w, *s: loader(p, w.float().reshape(-1), *s), "weight_scale")
        else:
            scale_loader = per_tensor_scale_loader(layer, self.format_name, self.prefix, "weight_scale", loader)
        set_weight_attrs(scale, {"output_dim": 0, **extra_weight_attrs, "weight_loader": scale_loader})
        layer.register_parameter("weight_scale", scale)
        if self.scheme.activations is not None and not self.scheme.activations.dynamic:
            input_scale = nn.Parameter(torch.zeros(1), requires_grad=False)
            set_weight_attrs(input_scale, {**extra_weight_attrs, "weight_loader": self._load_input_scale})
            layer.register_parameter("input_scale", input_scale)

    def _checked(self, loader: Callable[..., None], name: str) -> Callable[..., None]:
        """``loader`` with its errors naming the format, the layer and the tensor."""

        def load(param: nn.Parameter, loaded_weight: torch.Tensor, *shard_id: Any) -> None:
            if name == "weight" and loaded_weight.dtype != param.dtype:
                raise ValueError(
                    f"{self.format_name}: layer {self.prefix}, tensor 'weight': expected {param.dtype}, got "
                    f"{loaded_weight.dtype}."
                )
            try:
                loader(param, loaded_weight, *shard_id)
            except ValueError as exc:
                part = f" (part {shard_id[0]!r})" if shard_id else ""
                raise ValueError(f"{self.format_name}: layer {self.prefix}{part}, tensor {name!r}: {exc}") from None

        return load

    def _load_input_scale(self, param: nn.Parameter, loaded_weight: torch.Tensor, *shard_id: Any) -> None:
        if loaded_weight.numel() != 1:
            raise ValueError(
                f"{self.format_name}: layer {self.prefix}, tensor 'input_scale': expected one scale per tensor "
                f"(static activations, strategy 'tensor'), got shape {tuple(loaded_weight.shape)}."
            )
        param.data.copy_(torch.maximum(param.data, loaded_weight.to(param.device, torch.float32).reshape(1)))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Hand the weights to their kernel (see the module docstring); a second call changes nothing."""
        if getattr(layer, "w8a8_processed", False):
            return
        layer.w8a8_processed = True
        weight, scale = layer.weight.data, layer.weight_scale.data
        del layer.weight, layer.weight_scale
        if self.scheme.weight_type == "float":
            store_fp8(layer, weight, scale)
        elif self.scheme.activations is None:
            store_int8(layer, weight, scale)
        else:
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)
            self.int8_matmul = _int_mm if int8_gemm_exact_on_cpu() else _float_int8_mm

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype (see the module docstring)."""
        activations = self.scheme.activations
        if activations is None:
            return (apply_fp8 if self.scheme.weight_type == "float" else apply_int8)(layer, x, bias)
        rows = x.reshape(-1, x.shape[-1])
        static_scale = None if activations.dynamic else layer.input_scale
        if self.scheme.weight_type == "int":
            x_q, x_scale = quantize_int8_activations(rows, activations.per_token, static_scale)
            y = self.int8_matmul(x_q, layer.weight) * x_scale * layer.weight_scale
        else:
            x_q, x_scale = quantize_fp8_activations(rows, activations.per_token, static_scale)
            y = apply_fp8(layer, x_q, None) * x_scale
        if bias is not None:
            y = y + bias
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])

    def describe_path(self, layer: nn.Module) -> str:
        scheme = self.scheme
        if scheme.activations is None and scheme.weight_type == "int":
            return f"{self.format_name}: " + describe_int8(layer)
        kind = "int8" if scheme.weight_type == "int" else "fp8 e4m3"
        weights = f"{kind} weights per {'channel' if scheme.per_channel else 'tensor'}"
        if scheme.activations is None:
            return f"{self.format_name}: {weights}, weight-only ({fp8_kernel_name(layer)})"
        kernel = fp8_kernel_name(layer) if scheme.weight_type == "float" else (
            "torch._int_mm, int32 sums" if self.int8_matmul is _int_mm else "float32 matmul of the int8 values")
        return f"{self.format_name}: {weights}, {scheme.activations.describe()} ({kernel})"
