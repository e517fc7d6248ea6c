"""How a ``FusedMoE`` layer stores and applies its experts: ``FusedMoEMethodBase`` (the
LinearMethod seam for experts: ``create_weights``, ``process_weights_after_loading``,
``apply``) and ``UnquantizedFusedMoEMethod`` (weights in the model dtype).

A quantized format plugs in as another method: its ``QuantizationConfig.get_quant_method``
returns it for a ``FusedMoE`` layer (None keeps the unquantized one), it creates parameters
loaded through the layer's ``weight_loader`` and runs each expert inside
``expert_groups.fused_experts``. Once loaded, a method may re-lay the stacked weights out as
one ``ExpertMatrix`` per expert matrix (``split_experts``), each with its own ``cpu_gemm`` plan,
or, on CPU, in the blocks of the fused C++ kernel that computes every expert in one call
(``cpu_fused``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Optional

import torch
from torch import nn

from pagedllm.model_executor.layers import cpu_gemm
from pagedllm.model_executor.layers.fused_moe import cpu_fused
from pagedllm.model_executor.layers.fused_moe.expert_groups import fused_experts, group_by_expert
from pagedllm.model_executor.layers.quantization import QuantizeMethodBase
from pagedllm.model_executor.utils import set_weight_attrs
from pagedllm.platforms import current_platform


class ExpertMatrix(nn.Module):
    """One expert's matrix W [out, in] and its matmul ``gemm_plan(x [n, in], bias) -> [n, out]``,
    with the attributes the quantization formats' ``store_*`` functions and ``cpu_gemm``'s plans
    read of a linear layer (``weight``, ``weight_fp32``, ``output_size_per_partition``,
    ``input_size_per_partition``, and ``output_partition_sizes``: the rows of each checkpoint
    matrix it holds, [I, I] for W13's gate and up); torch's matmul until prepared."""

    def __init__(self, weight: torch.Tensor, output_partition_sizes: Optional[list[int]] = None,
                 kind: str = "w13") -> None:
        super().__init__()
        #: Which of the layer's matrices this is: "w13" or "w2".
        self.kind = kind
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_fp32", None, persistent=False)
        self.output_size_per_partition, self.input_size_per_partition = weight.shape
        self.output_partition_sizes = output_partition_sizes or [weight.shape[0]]
        self.gemm_plan = cpu_gemm.TorchGemm(self)


def split_experts(layer: nn.Module, prepare: Callable[..., None], tensors: tuple[str, ...] = ("weight",)) -> None:
    """Replace ``layer``'s stacked ``w13_<tensor>`` / ``w2_<tensor>`` parameters (``tensors``:
    the weight first, e.g. ``("qweight", "scales", "qzeros")``; default ``w13_weight`` /
    ``w2_weight``) by ``w13_experts`` / ``w2_experts``, one ``ExpertMatrix`` per local expert
    holding the expert's slice of the first (its ``kind`` "w13" or "w2"; W13's
    ``output_partition_sizes`` its gate and up rows, or up alone for an ungated layer), each
    passed to ``prepare(matrix, *the expert's slices of the other tensors)``, which sets its
    layout and plan; a second call changes nothing."""
    if not hasattr(layer, f"w13_{tensors[0]}"):
        return
    w13_parts = [layer.intermediate_size_per_partition] * (2 if getattr(layer, "is_act_and_mul", True) else 1)
    for name, parts in (("w13", w13_parts), ("w2", None)):
        stacked = [getattr(layer, f"{name}_{tensor}").data for tensor in tensors]
        matrices = nn.ModuleList(ExpertMatrix(w, parts, name) for w in stacked[0])
        for expert, matrix in enumerate(matrices):
            prepare(matrix, *(tensor[expert] for tensor in stacked[1:]))
        for tensor in tensors:
            delattr(layer, f"{name}_{tensor}")
        setattr(layer, f"{name}_experts", matrices)


def register_checked(layer: nn.Module, name: str, check: Callable[[torch.Tensor, str, str], Optional[str]],
                     format_name: str) -> None:
    """Register on ``layer`` (a ``FusedMoE``) the empty parameter ``name`` (``w13_g_idx`` ...)
    for a per-expert checkpoint tensor that is read and checked, not kept: ``check(tensor,
    shard id, matrix "w13" / "w2")`` returns what is wrong with it, or None; the parameter
    counts as loaded per expert matrix (``FusedMoE.record_loaded``) and ``drop_checked``
    removes it after loading.

    Raises (when loading):
        ValueError: what ``check`` found (names ``format_name`` and the tensor).
    """
    matrix = name.split("_", 1)[0]

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int) -> None:
        problem = check(loaded_weight, shard_id, matrix)
        if problem is not None:
            raise ValueError(f"{format_name}: checkpoint tensor {weight_name!r}: {problem}")
        if layer.local_expert(expert_id) is not None:
            layer.record_loaded(param, shard_id, expert_id)

    param = nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False)
    param.weight_loader = load
    layer.register_parameter(name, param)


def drop_checked(layer: nn.Module) -> None:
    """Remove ``layer``'s ``register_checked`` parameters (empty ``w13_*`` / ``w2_*``)."""
    for name, param in list(layer.named_parameters(recurse=False)):
        if param.numel() == 0 and name.startswith(("w13_", "w2_")):
            delattr(layer, name)


def _expert_biases(layer: nn.Module, expert: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Local expert ``expert``'s W13 bias [2 x I] and W2 bias [H] (None without biases; W2's
    None on tensor-parallel ranks other than 0, whose partial sums add to rank 0's)."""
    if not getattr(layer, "has_bias", False):
        return None, None
    return layer.w13_bias[expert], (layer.w2_bias[expert] if layer.moe_tp_rank == 0 else None)


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [n, in] @ weight [out, in]^T (+ bias [out], added after the product as transformers does)."""
    out = torch.mm(x, weight.t())
    return out if bias is None else out.add_(bias)


class FusedMoEMethodBase(QuantizeMethodBase):
    """How a ``FusedMoE`` layer stores its experts' W13 ([gate | up], [2 x I, H] each) and
    W2 ([H, I] each) and computes the routed experts' weighted sum."""

    #: Whether the method applies ``FusedMoE(has_bias=True)``'s ``w13_bias`` / ``w2_bias``.
    supports_bias = False
    #: Whether the method holds ungated experts (``FusedMoE.is_act_and_mul`` False: W13 [I, H]).
    supports_ungated = False

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
        params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        """Register on ``layer`` what stores this rank's ``num_experts`` experts (their
        ``intermediate_size_per_partition`` columns of I), each parameter with
        ``extra_weight_attrs`` (``weight_loader``) as attributes."""

    @abstractmethod
    def expert_forward(self, layer: nn.Module, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Local expert ``expert``'s gated MLP (``layer.act_fn``) on its tokens: rows [n, H] ->
        [n, H] (this rank's intermediate columns only: a partial sum under tensor parallelism)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] with each token's ``topk_ids`` [T, k] (global expert ids, int64) and
        ``topk_weights`` [T, k] (float32) -> [T, H] in x's dtype: the sum of this rank's
        experts' weighted outputs (``expert_groups``: one ``expert_forward`` per active expert)."""
        groups = group_by_expert(topk_weights, topk_ids, layer.local_num_experts, layer.expert_map)
        return fused_experts(x, groups, lambda expert, rows: self.expert_forward(layer, expert, rows))


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """``w13_weight`` [E, 2 x I, H] ([gate | up] rows per expert; [E, I, H], up alone, for an
    ungated layer) and ``w2_weight`` [E, H, I] in the model dtype (E, I: this rank's experts and
    intermediate columns); each expert is two torch matmuls and ``layer.act_fn`` over its group
    of tokens. With ``layer.has_bias``, also ``w13_bias`` [E, 2 x I] and ``w2_bias`` [E, H]
    (added by tensor-parallel rank 0 only: the ranks' partial sums are added up)."""

    supports_bias = True
    supports_ungated = True

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
        params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        inter = intermediate_size_per_partition
        w13_rows = (2 if getattr(layer, "is_act_and_mul", True) else 1) * inter
        shapes = [("w13_weight", (num_experts, w13_rows, hidden_size)), ("w2_weight", (num_experts, hidden_size, inter))]
        if getattr(layer, "has_bias", False):
            shapes += [("w13_bias", (num_experts, w13_rows)), ("w2_bias", (num_experts, hidden_size))]
        for name, shape in shapes:
            weight = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
            set_weight_attrs(weight, extra_weight_attrs)
            layer.register_parameter(name, weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On CPU with the C++ kernels, bfloat16 / float16 / float32 experts under "silu" or
        "relu2_no_mul" are packed for the fused kernel (``cpu_fused.can_fuse``: every expert
        in one call); other 16-bit experts that this machine has no native matmul for get one
        ``linear_w16`` plan per matrix (``cpu_gemm.plan_unquantized``, no float32 copy: the
        experts are most of the model); otherwise the stacked weights stay for torch's matmul.
        A second call changes nothing."""
        if cpu_fused.can_fuse(layer):
            cpu_fused.pack_for_fused_kernel(layer)
        elif (current_platform.is_cpu and hasattr(layer, "w13_weight")
                and cpu_gemm.should_widen(layer.w13_weight.data[0])):
            split_experts(layer, lambda matrix: setattr(matrix, "gemm_plan", cpu_gemm.plan_unquantized(matrix, False)))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """As ``FusedMoEMethodBase.apply``; a layer packed for the fused kernel runs it once."""
        if not hasattr(layer, "w13_packed"):
            return super().apply(layer, x, topk_weights, topk_ids)
        groups = group_by_expert(topk_weights, topk_ids, layer.local_num_experts, layer.expert_map)
        return cpu_fused.fused_kernel_experts(layer, x, groups)

    def expert_forward(self, layer: nn.Module, expert: int, rows: torch.Tensor) -> torch.Tensor:
        w13_bias, w2_bias = _expert_biases(layer, expert)
        if hasattr(layer, "w13_experts"):
            gate_up = layer.w13_experts[expert].gemm_plan(rows, w13_bias)
            return layer.w2_experts[expert].gemm_plan(layer.act_fn(gate_up), w2_bias)
        gate_up = _mm(rows, layer.w13_weight[expert], w13_bias)
        return _mm(layer.act_fn(gate_up), layer.w2_weight[expert], w2_bias)

    def describe_path(self, layer: nn.Module) -> str:
        if hasattr(layer, "w13_packed"):
            return cpu_fused.describe(layer)
        if hasattr(layer, "w13_experts"):
            return f"experts: {layer.w13_experts[0].gemm_plan.describe()}" if len(layer.w13_experts) else "experts"
        return f"experts: torch {str(layer.w13_weight.dtype).removeprefix('torch.')} matmul"
