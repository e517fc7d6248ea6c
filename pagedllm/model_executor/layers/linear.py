"""Linear layers (vLLM's shapes): ``ReplicatedLinear``, ``ColumnParallelLinear``,
``MergedColumnParallelLinear``, ``QKVParallelLinear`` and ``RowParallelLinear``, each holding a
``quant_method`` (a ``LinearMethodBase``) that creates, prepares and applies its weight.

Sharding: a column-parallel layer holds this rank's rows of W (output features), a
row-parallel one this rank's columns (input features; its outputs are summed over the ranks
by ``tensor_model_parallel_all_reduce``); ranks and sizes come from
``pagedllm.distributed.parallel_state`` (at tensor-parallel size 1 every layer holds all of W).
Several checkpoint matrices may be fused into one layer (q/k/v into ``qkv_proj``, gate/up
into ``gate_up_proj``); each parameter carries a ``weight_loader`` that copies this rank's
part of a checkpoint tensor into its shard. Output rows of a fused layer are the shards
stacked in order: ``[q | k | v]`` or ``[gate | up]`` (per rank).

``UnquantizedLinearMethod`` keeps weights in the model dtype; once loaded, each layer's
matmul is one plan (``layer.gemm_plan``, chosen by ``cpu_gemm.plan_unquantized`` on CPU), and
``apply`` calls it.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from pagedllm.distributed import (
    divide,
    kv_heads_per_rank,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedllm.model_executor.layers import cpu_gemm
from pagedllm.model_executor.layers.quantization import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.utils import default_weight_loader, load_weight_part, set_weight_attrs
from pagedllm.platforms import current_platform

ShardId = Union[str, int]

class LinearMethodBase(QuantizeMethodBase):
    """How a linear layer stores and applies its weight W (y = x W^T + b)."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """Register on ``layer`` what stores this rank's [sum(output_partition_sizes),
        input_size_per_partition] part of the [output_size, input_size] matrix, each parameter
        with ``extra_weight_attrs`` (``weight_loader`` ...) as attributes."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., input_size_per_partition] -> [..., layer.output_size_per_partition], x's dtype."""


class UnquantizedLinearMethod(LinearMethodBase):
    """W in the model dtype, ``weight`` [out, in]; a ``weight_fp32`` buffer (else None); the
    matmul in ``layer.gemm_plan`` (``cpu_gemm``): torch's on ``weight`` until
    ``process_weights_after_loading`` picks, once and on CPU only, the fastest plan here
    (``cpu_gemm.plan_unquantized``), re-laying out ``weight`` for it.
    """

    #: Whether a ``linear_w16`` weight also gets a float32 copy (``fp32_weight_copy``).
    float32_copy = True

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype), requires_grad=False
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        layer.register_buffer("weight_fp32", None, persistent=False)
        layer.gemm_plan = cpu_gemm.TorchGemm(layer)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Choose the layer's plan for this machine (see the class docstring); a second call
        changes nothing."""
        weight = layer.weight.data
        if not current_platform.is_cpu or weight.is_mkldnn or weight.dim() != 2:
            return
        layer.gemm_plan = cpu_gemm.plan_unquantized(layer, self.float32_copy)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return layer.gemm_plan(x, bias)

    def describe_path(self, layer: nn.Module) -> str:
        return layer.gemm_plan.describe()


class LinearBase(nn.Module):
    """A linear layer y = x W^T + b (W [output_size, input_size]) whose ``quant_method``
    creates, prepares and applies its weight.

    Args:
        input_size, output_size: features of the whole matrix (all ranks together).
        params_dtype: dtype of the parameters (None: torch's default dtype).
        quant_config: picks ``quant_method`` via ``get_quant_method(self, prefix)``; None,
            or a None answer: ``UnquantizedLinearMethod``.
        prefix: the layer's name in the model (``model.layers.0.mlp.down_proj``).

    Subclasses set ``input_size_per_partition`` and ``output_size_per_partition`` (this
    rank's features) through ``_create_weights``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        params_dtype: Optional[torch.dtype] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        method = None if quant_config is None else quant_config.get_quant_method(self, prefix)
        self.quant_method: QuantizeMethodBase = method or UnquantizedLinearMethod()

    def _create_weights(
        self, input_size_per_partition: int, output_partition_sizes: list[int], bias: bool, bias_sharded: bool
    ) -> None:
        """Let ``quant_method`` create the weight of this rank's part, and add a bias [this
        rank's outputs if ``bias_sharded``, else all of them] in ``params_dtype``."""
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.output_size_per_partition = sum(output_partition_sizes)
        self.quant_method.create_weights(
            self, input_size_per_partition, output_partition_sizes, self.input_size, self.output_size,
            self.params_dtype, weight_loader=self.weight_loader,
        )
        if not bias:
            self.register_parameter("bias", None)
            return
        size = self.output_size_per_partition if bias_sharded else self.output_size
        self.bias = nn.Parameter(torch.empty(size, dtype=self.params_dtype), requires_grad=False)
        set_weight_attrs(self.bias, {"weight_loader": self.weight_loader, **({"output_dim": 0} if bias_sharded else {})})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's part of a checkpoint tensor into ``param`` (one of this layer's)."""
        raise NotImplementedError

    def input_part(self) -> tuple[int, int]:
        """(this rank's part, number of equal parts) of W's input features: (0, 1), all of
        them, unless the layer is row-parallel. A LoRA A [r, in] is cut the same way."""
        return 0, 1

    def output_part(self, index: int) -> tuple[int, int]:
        """(this rank's part, number of equal parts) of fused matrix ``index``'s output
        features: (0, 1), all of them, unless the layer is column-parallel. A LoRA B
        [out, r] of that matrix is cut the same way."""
        return 0, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size_per_partition] -> [..., output_size_per_partition], x's dtype."""
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole: [..., input_size] -> [..., output_size].
    ``kwargs``: ``LinearBase``'s (params_dtype, quant_config, prefix)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self._create_weights(input_size, [output_size], bias, bias_sharded=False)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy a checkpoint tensor into ``param``.

        Raises:
            ValueError: if the shapes differ.
        """
        default_weight_loader(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: this rank holds rows [rank x out / tp_size, ...)
    of W (and of the bias) and computes those outputs.

    Args:
        gather_output: whether ``forward`` concatenates the ranks' outputs (all_gather) into
            [..., output_size]; else it returns this rank's [..., output_size_per_partition].
        output_sizes: the sizes of fused matrices stacked in W (default ``[output_size]``),
            each split evenly across ranks: this rank's W is their parts, stacked.
        kwargs: ``LinearBase``'s (params_dtype, quant_config, prefix).

    Raises:
        ValueError: an output size not divisible by the tensor-parallel size.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        output_sizes: Optional[Sequence[int]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.gather_output = gather_output
        self.output_sizes = list(output_sizes or [output_size])
        #: The name of each fused matrix for ``weight_loader`` (``loaded_shard_id``).
        self.shard_ids: list[ShardId] = list(range(len(self.output_sizes)))
        self._create_weights(input_size, [divide(size, self.tp_size) for size in self.output_sizes], bias, bias_sharded=True)

    def output_part(self, index: int) -> tuple[int, int]:
        """(this rank's part, number of parts) of fused matrix ``index``'s checkpoint rows."""
        return self.tp_rank, self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: Optional[ShardId] = None) -> None:
        """Copy this rank's rows of a checkpoint tensor into ``param``: of fused matrix
        ``loaded_shard_id`` (one of ``shard_ids``), or (None) of the whole W, whose fused
        matrices are then stacked in the checkpoint tensor in order.

        Raises:
            ValueError: a wrong shape or an unknown shard id.
        """
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # not split by output (a quantized format's scalar, say)
            default_weight_loader(param, loaded_weight)
            return
        if loaded_shard_id is None and len(self.shard_ids) > 1:
            self._load_fused(param, loaded_weight, output_dim)
            return
        index = 0 if loaded_shard_id is None else self._shard_index(loaded_shard_id)
        offset = sum(self.output_partition_sizes[:index])
        param_data = param.data.narrow(output_dim, offset, self.output_partition_sizes[index])
        load_weight_part(param_data, loaded_weight, output_dim, *self.output_part(index))

    def _shard_index(self, shard_id: ShardId) -> int:
        if shard_id not in self.shard_ids:
            raise ValueError(f"Unknown shard id {shard_id!r}; this layer's are {self.shard_ids}.")
        return self.shard_ids.index(shard_id)

    def _load_fused(self, param: nn.Parameter, loaded_weight: torch.Tensor, output_dim: int) -> None:
        """Load a checkpoint tensor holding every fused matrix, stacked, shard by shard."""
        rows = [size * self.output_part(i)[1] for i, size in enumerate(self.output_partition_sizes)]
        if loaded_weight.shape[output_dim] != sum(rows):
            raise ValueError(
                f"Checkpoint tensor shape {tuple(loaded_weight.shape)}: dimension {output_dim} should be "
                f"{' + '.join(map(str, rows))} (the fused matrices {self.shard_ids})."
            )
        for shard_id, part in zip(self.shard_ids, loaded_weight.split(rows, dim=output_dim)):
            self.weight_loader(param, part, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size] with ``gather_output``, else
        [..., output_size_per_partition]; x's dtype."""
        out = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            out = tensor_model_parallel_all_gather(out)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices of the same input fused into one matmul (gate/up):
    ``output_sizes`` are their output features, in output order; shard ids are their
    indices (0, 1, ...). ``kwargs``: ``ColumnParallelLinear``'s (gather_output ...)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = True, **kwargs: Any) -> None:
        super().__init__(input_size, sum(output_sizes), bias, output_sizes=output_sizes, **kwargs)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection of ``hidden_size`` inputs. Per rank, output
    ``[q (num_heads x head_size) | k | v (num_kv_heads x head_size)]``: ``total_num_heads /
    tp_size`` query heads, and ``total_num_kv_heads / tp_size`` KV heads, or one KV head
    replicated on ``tp_size / total_num_kv_heads`` ranks when there are at least as many
    ranks as KV heads. Shard ids "q", "k", "v". ``kwargs``: ``LinearBase``'s (params_dtype,
    quant_config, prefix).

    Raises:
        ValueError: head counts that do not split across the ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: Optional[int] = None,
        bias: bool = True,
        **kwargs: Any,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = kv_heads_per_rank(self.total_num_kv_heads, tp_size)
        self.num_kv_head_replicas = max(1, tp_size // self.total_num_kv_heads)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # Sizes over all ranks, replicas counted, so that each splits evenly (vLLM's convention).
        sizes = [self.q_size * tp_size, self.kv_size * tp_size, self.kv_size * tp_size]
        super().__init__(hidden_size, sum(sizes), bias, output_sizes=sizes, **kwargs)
        self.shard_ids = ["q", "k", "v"]

    def output_part(self, index: int) -> tuple[int, int]:
        if index == 0:
            return self.tp_rank, self.tp_size
        return self.tp_rank // self.num_kv_head_replicas, self.tp_size // self.num_kv_head_replicas


class RowParallelLinear(LinearBase):
    """Input features split across ranks: this rank holds columns [rank x in / tp_size, ...)
    of W and takes x [..., input_size_per_partition] (a column-parallel layer's output); the
    bias (whole) is added on rank 0 only.

    Args:
        reduce_results: whether ``forward`` sums the ranks' partial outputs (all_reduce).
        kwargs: ``LinearBase``'s (params_dtype, quant_config, prefix).

    Raises:
        ValueError: an input size not divisible by the tensor-parallel size.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, reduce_results: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.reduce_results = reduce_results
        self._create_weights(divide(input_size, self.tp_size), [output_size], bias, bias_sharded=False)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's columns of a checkpoint tensor into ``param`` (the whole bias).

        Raises:
            ValueError: a wrong shape.
        """
        load_weight_part(param.data, loaded_weight, getattr(param, "input_dim", None), *self.input_part())

    def input_part(self) -> tuple[int, int]:
        return self.tp_rank, self.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size_per_partition] -> [..., output_size], x's dtype (this rank's
        partial sum unless ``reduce_results``)."""
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
