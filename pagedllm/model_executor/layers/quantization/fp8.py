"""FP8 weights (float8 e4m3, the OCP format of Micikevicius et al. 2022, arXiv:2209.05433):

- ``--quantization fp8`` on a 16/32-bit checkpoint (vLLM's online FP8): each checkpoint
  weight (each part of a fused q/k/v or gate/up layer) gets one scale, scale = max|W| / 448
  (e4m3's largest finite value), F = W / scale rounded to e4m3;
- checkpoints with ``quant_method: "fp8"`` (as AutoFP8, llm-compressor and vLLM write them):
  per linear module ``weight`` float8_e4m3fn [out, in] and ``weight_scale`` (a scalar per
  tensor; fused q/k/v and gate/up parts keep their own), W = weight_scale * F; an
  ``input_scale`` (``activation_scheme: "static"``) is read and not used: activations stay in
  the model dtype, which is at least as exact. Block-wise checkpoints (``weight_block_size``,
  ``weight_scale_inv`` per block) are dequantized at load, with a warning. Modules listed in
  ``ignored_layers`` / ``modules_to_not_convert`` stay unquantized.

``FusedMoE`` experts under ``--quantization fp8`` (``Fp8FusedMoEMethod``): each expert's gate,
up and down matrices get their own scale the same way, one plan per matrix (W13, W2); routers
stay in the model dtype. A per-tensor FP8 checkpoint's experts (``experts.<e>.w1.weight`` /
``weight_scale`` ...) are read as they are (``Fp8CheckpointFusedMoEMethod``); block-wise ones
are refused at load, for now.

On CPU the matmul is ``pagedllm.kernels.cpu.linear_fp8``: one byte per weight streamed and
widened exactly to float32 in the kernel, the scale applied once per output. The lm_head keeps
the model dtype.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers import cpu_gemm
from pagedllm.model_executor.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod
from pagedllm.model_executor.layers.fused_moe.methods import drop_checked, register_checked, split_experts
from pagedllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.layers.quantization.packed_int import checkpoint_module_names, name_matches
from pagedllm.model_executor.utils import set_weight_attrs
from pagedllm.platforms import current_platform

logger = logging.getLogger(__name__)

#: The largest finite float8 e4m3 value.
FP8_E4M3_MAX = 448.0


def quantize_fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (F [N, K] float8_e4m3fn, scale: a float32 scalar tensor) with W ~ scale * F
    (see the module docstring); an all-zero W gets scale 1."""
    w = weight.float()
    amax = w.abs().max()
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    return (w / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


class Fp8Config(QuantizationConfig):
    """Online FP8 (``--quantization fp8``, empty config) or a ``quant_method: "fp8"``
    checkpoint: ``weight_block_size``, ``ignored_layers`` / ``modules_to_not_convert``.

    Raises (``from_config``):
        ValueError: a block size that is not two positive integers.
    """

    def __init__(self, serialized: bool, block_size: Optional[list[int]], ignored: list[str]) -> None:
        self.serialized = serialized
        self.block_size = block_size
        self.ignored = ignored

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8Config":
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"fp8: weight_block_size must be two positive integers, got {block!r}.")
        ignored = list(config.get("ignored_layers") or []) + list(config.get("modules_to_not_convert") or [])
        return cls(config.get("quant_method") == "fp8", block, ignored)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        """``Fp8LinearMethod`` for a linear layer, ``Fp8FusedMoEMethod`` for ``FusedMoE`` experts
        (``Fp8CheckpointFusedMoEMethod`` for a per-tensor checkpoint's), None for other layers
        and ignored ones.

        Raises:
            ValueError: ``FusedMoE`` experts of a block-wise FP8 checkpoint (not read yet; names the layer).
        """
        if not isinstance(layer, (LinearBase, FusedMoE)):
            return None
        if any(name_matches(name, pattern) for name in checkpoint_module_names(prefix) for pattern in self.ignored):
            return None
        if isinstance(layer, LinearBase):
            return Fp8LinearMethod(self, prefix)
        if self.serialized and self.block_size is not None:
            raise ValueError(f"fp8: the experts {prefix} have block-wise scales (weight_block_size), which cannot "
                             "be read for experts yet; per-tensor FP8 checkpoints can.")
        return Fp8CheckpointFusedMoEMethod() if self.serialized else Fp8FusedMoEMethod()


def store_fp8(layer: nn.Module, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Replace ``layer.weight`` by F [out, in] float8_e4m3fn with ``weight_scale`` [out]
    float32 (W = scale[:, None] * F), and set ``layer.gemm_plan``: ``pack_w8``'s blocked
    layout on CPU with the kernels (``Scaled8BitGemm`` with ``linear_fp8``), else F itself
    (``DequantizedTorchGemm``)."""
    kernels = current_platform.is_cpu and cpu_kernels.is_available()
    if kernels:
        weight = cpu_kernels.pack_w8(weight.view(torch.int8)).view(torch.float8_e4m3fn)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)
    if kernels:
        n = layer.output_size_per_partition
        layer.gemm_plan = cpu_gemm.Scaled8BitGemm(layer.weight, layer.weight_scale, n, cpu_kernels.linear_fp8)
    else:
        layer.gemm_plan = cpu_gemm.DequantizedTorchGemm(layer.weight, layer.weight_scale)


def store_fp8_per_part(layer: nn.Module) -> None:
    """Quantize ``layer.weight`` [out, in] (float) to FP8 with one scale per checkpoint matrix
    (``quantize_fp8_per_tensor`` on each of ``layer.output_partition_sizes``' row ranges:
    q / k / v, gate / up) and ``store_fp8`` it."""
    parts = [quantize_fp8_per_tensor(part) for part in layer.weight.data.split(layer.output_partition_sizes)]
    scales = [scale.expand(f8.shape[0]) for f8, scale in parts]
    store_fp8(layer, torch.cat([f8 for f8, _ in parts]), torch.cat(scales))


def apply_fp8(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W^T + b`` for a layer prepared by ``store_fp8``: x [..., in] -> [..., out] in x's
    dtype, by its plan."""
    return layer.gemm_plan(x, bias)


def fp8_kernel_name(layer: nn.Module) -> str:
    """The start-up log's name of a ``store_fp8`` layer's matmul."""
    if isinstance(layer.gemm_plan, cpu_gemm.Scaled8BitGemm):
        return "linear_fp8; many rows: linear_dequant"
    return "torch matmul on dequantized W"


def checkpoint_rows(layer: nn.Module, shard_id: tuple[Any, ...]) -> int:
    """Output rows of the checkpoint tensor a shard id loads (the whole layer's without one)."""
    if not shard_id:
        return layer.output_size
    return layer.output_sizes[layer.shard_ids.index(shard_id[0])]


def per_tensor_scale_loader(
    layer: nn.Module, format_name: str, prefix: str, name: str, loader: Callable[..., None]
) -> Callable[..., None]:
    """A ``weight_loader`` for a per-output [out] float32 parameter fed by a checkpoint
    scalar per tensor (each part of a fused layer has its own): the scalar is repeated over
    the part's rows, then ``loader`` slices and places them.

    Raises (when loading):
        ValueError: the checkpoint tensor ``name`` of layer ``prefix`` holds more than one value
            (the message names ``format_name``, the layer and the tensor).
    """

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, *shard_id: Any) -> None:
        if loaded_weight.numel() != 1:
            raise ValueError(
                f"{format_name}: layer {prefix}, tensor {name!r}: expected one scale per tensor, got shape "
                f"{tuple(loaded_weight.shape)} (per-channel scales load from compressed-tensors checkpoints, "
                "weights strategy 'channel')."
            )
        loader(param, loaded_weight.float().reshape(1).expand(checkpoint_rows(layer, shard_id)), *shard_id)

    return load


class Fp8LinearMethod(UnquantizedLinearMethod):
    """One FP8 layer (see the module docstring)."""

    def __init__(self, config: Fp8Config, prefix: str) -> None:
        self.config = config
        self.prefix = prefix

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        if not self.config.serialized:
            super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                                   params_dtype, **extra_weight_attrs)  # fmt: skip
            return
        loader: Callable[..., None] = extra_weight_attrs.pop("weight_loader")
        out = sum(output_partition_sizes)
        per_output = {"output_dim": 0, "input_dim": 1, **extra_weight_attrs}
        params: dict[str, tuple[torch.Tensor, dict[str, Any], Callable[..., None]]] = {
            "weight": (torch.empty(out, input_size_per_partition, dtype=torch.float8_e4m3fn), per_output, loader),
            "input_scale": (torch.empty(1), dict(extra_weight_attrs), self._scalar_loader),
        }
        if self.config.block_size is None:
            params["weight_scale"] = (torch.empty(out), {"output_dim": 0, **extra_weight_attrs},
                                      per_tensor_scale_loader(layer, "fp8", self.prefix, "weight_scale", loader))  # fmt: skip
        else:  # kept with one row per output (a fused layer's parts load row ranges)
            shape = (out, -(-input_size_per_partition // self.config.block_size[1]))
            params["weight_scale_inv"] = (torch.empty(shape), per_output, self._block_scale_loader(layer, loader))
        for name, (tensor, attrs, param_loader) in params.items():
            param = nn.Parameter(tensor, requires_grad=False)
            set_weight_attrs(param, {**attrs, "weight_loader": param_loader})
            layer.register_parameter(name, param)
        layer.register_buffer("weight_fp32", None, persistent=False)

    @staticmethod
    def _scalar_loader(param: nn.Parameter, loaded_weight: torch.Tensor, *shard_id: Any) -> None:
        param.data.copy_(loaded_weight.float().reshape(-1)[:1])

    def _block_scale_loader(self, layer: nn.Module, loader: Callable[..., None]) -> Callable[..., None]:
        def load(param: nn.Parameter, loaded_weight: torch.Tensor, *shard_id: Any) -> None:
            rows = checkpoint_rows(layer, shard_id)
            per_row = loaded_weight.float().repeat_interleave(self.config.block_size[0], 0)[:rows]
            loader(param, per_row, *shard_id)

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize (online), or hand the checkpoint's FP8 weight to the kernel; block-wise
        weights are dequantized to the model dtype. A second call changes nothing."""
        if getattr(layer, "fp8_processed", False):
            return
        layer.fp8_processed = True
        weight = layer.weight.data
        if not self.config.serialized:
            store_fp8_per_part(layer)
            return
        del layer.input_scale
        if self.config.block_size is None:
            store_fp8(layer, weight, layer.weight_scale.data)
            return
        scale = layer.weight_scale_inv.data.repeat_interleave(self.config.block_size[1], 1)
        dequantized = weight.float() * scale[:, : weight.shape[1]]
        del layer.weight_scale_inv
        logger.warning("fp8: layer %s has block-wise scales: no kernel for them yet, dequantized at load.", self.prefix)
        layer.weight = nn.Parameter(dequantized.to(layer.params_dtype), requires_grad=False)
        layer.gemm_plan = cpu_gemm.TorchGemm(layer)
        super().process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if layer.weight.dtype != torch.float8_e4m3fn:
            return super().apply(layer, x, bias)
        return apply_fp8(layer, x, bias)

    def describe_path(self, layer: nn.Module) -> str:
        if layer.weight.dtype != torch.float8_e4m3fn:
            return "fp8 block-wise, dequantized at load: " + super().describe_path(layer)
        return f"fp8 e4m3 weight-only, per-tensor scales ({fp8_kernel_name(layer)})"


class Fp8FusedMoEMethod(UnquantizedFusedMoEMethod):
    """Loads the experts like the unquantized method, then keeps each expert's W13 [2 x I, H]
    (one scale for the gate rows, one for the up rows) and W2 [H, I] (one scale) only in FP8
    form (``store_fp8_per_part`` on each of ``split_experts``' matrices)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize the loaded experts; a second call changes nothing."""
        split_experts(layer, store_fp8_per_part)

    def describe_path(self, layer: nn.Module) -> str:
        if not len(layer.w13_experts):
            return "experts: fp8"
        return f"experts: fp8 e4m3 weight-only, per-tensor scales ({fp8_kernel_name(layer.w13_experts[0])})"


class Fp8CheckpointFusedMoEMethod(UnquantizedFusedMoEMethod):
    """``FusedMoE`` experts of a per-tensor FP8 checkpoint: per expert matrix ``weight``
    float8_e4m3fn and a scalar ``weight_scale`` (``input_scale`` read and not used), held as
    ``w13_weight`` [E, 2 x I, H] / ``w2_weight`` [E, H, I] float8 and ``w13_weight_scale``
    [E, 2 x I] / ``w2_weight_scale`` [E, H] float32 (each matrix's scalar over its rows), then
    one ``store_fp8`` plan per expert matrix.

    Raises (when loading):
        ValueError: a ``weight_scale`` of more than one value (names the tensor).
    """

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
        params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, torch.float8_e4m3fn,
                               **extra_weight_attrs)  # fmt: skip
        loader: Callable[..., None] = extra_weight_attrs["weight_loader"]
        rows = {"w1": intermediate_size_per_partition * layer.moe_tp_size, "w2": hidden_size}
        rows["w3"] = rows["w1"]

        def load_scale(param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, shard_id: str,
                       expert_id: int) -> None:
            if loaded_weight.numel() != 1:
                raise ValueError(f"fp8: checkpoint tensor {weight_name!r} has {loaded_weight.numel()} values; experts "
                                 "are read with one scale per tensor.")
            loader(param, loaded_weight.float().reshape(1).expand(rows[shard_id]), weight_name, shard_id, expert_id)

        for matrix, shape in (("w13", layer.w13_weight.shape[:2]), ("w2", layer.w2_weight.shape[:2])):
            param = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(param, {"weight_loader": load_scale})
            layer.register_parameter(f"{matrix}_weight_scale", param)
            register_checked(layer, f"{matrix}_input_scale", lambda *_: None, "fp8")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Hand each expert matrix to ``linear_fp8``; a second call changes nothing."""
        drop_checked(layer)
        split_experts(layer, lambda matrix, scale: store_fp8(matrix, matrix.weight.data, scale),
                      ("weight", "weight_scale"))

    def describe_path(self, layer: nn.Module) -> str:
        if not len(layer.w13_experts):
            return "experts: fp8"
        return f"experts: fp8 e4m3 weight-only, per-tensor scales ({fp8_kernel_name(layer.w13_experts[0])})"
