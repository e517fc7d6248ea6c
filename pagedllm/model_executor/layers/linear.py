"""Linear layers whose parameters know how to load themselves from a checkpoint.

Several checkpoint matrices may be fused into one layer (q/k/v into ``qkv_proj``,
gate/up into ``gate_up_proj``); each parameter carries a ``weight_loader`` that copies a
checkpoint tensor into its shard. Output rows of a fused layer are the shards stacked in
order: ``[q | k | v]`` or ``[gate | up]``.

On CPU, once loaded, weights are re-laid out in oneDNN's blocked format for the matmul
(``pack_weight``; ``process_weights_after_loading``). The product is bit-identical in bf16
and equal up to float32 summation order in float32, and much faster for the small row
counts of decode steps, measured on a 2-core AVX-512-BF16 machine (GFLOP/s, 896 -> 9728):
1 row 42 -> 109, 32 rows 231 -> 402, 512 rows 406 -> 417 (``torch.nn.functional.linear``
-> packed). A packed ``weight`` keeps its shape but is an opaque ``torch._mkldnn``
tensor: use it only through ``linear``. ``PAGEDLLM_DISABLE_CPU_KERNELS=1`` keeps the plain layout.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

ShardId = Union[str, int]

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([out, in], on CPU) can use oneDNN's pre-packed matmul here:
    torch built with oneDNN, float32 or bfloat16 (bf16 only where oneDNN supports it on
    this CPU), and ``PAGEDLLM_DISABLE_CPU_KERNELS`` unset."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in _PACKABLE_DTYPES:
        return False
    if os.environ.get("PAGEDLLM_DISABLE_CPU_KERNELS", "") not in ("", "0"):
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return weight.dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] re-laid out for ``torch.ops.mkldnn._linear_pointwise``: a new
    tensor of the same shape and dtype in the ``torch._mkldnn`` layout (wrap it in a new
    ``nn.Parameter``; it cannot become a strided parameter's ``.data``). Call only when
    ``can_pack(weight)``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x W^T + b for x [..., in] and W [out, in] (plain, or ``pack_weight``'s output)
    -> [..., out], x's dtype."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param`` (casting dtype).

    Raises:
        ValueError: if the shapes differ.
    """
    if param.shape != loaded_weight.shape:
        raise ValueError(f"Checkpoint tensor shape {tuple(loaded_weight.shape)} != parameter shape {tuple(param.shape)}.")
    param.data.copy_(loaded_weight)


class Linear(nn.Module):
    """y = x W^T + b. Weight [output_size, input_size], the module's dtype."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: Optional[nn.Parameter] = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        default_weight_loader(param, loaded_weight)

    def process_weights_after_loading(self) -> None:
        """Pack the loaded weight for the CPU matmul when possible (see the module docstring)."""
        if not self.packed and can_pack(self.weight.data):
            self.weight = nn.Parameter(pack_weight(self.weight.data), requires_grad=False)

    @property
    def packed(self) -> bool:
        """Whether the weight is packed for oneDNN (``process_weights_after_loading``)."""
        return self.weight.is_mkldnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """Several linear maps of the same input, fused into one matmul.

    Args:
        input_size: features in.
        shard_sizes: output features of each fused map, in output order.
        shard_ids: the id of each shard as the model's checkpoint mapping names it.
    """

    def __init__(self, input_size: int, shard_sizes: Sequence[int], shard_ids: Sequence[ShardId], bias: bool = False) -> None:
        super().__init__(input_size, sum(shard_sizes), bias)
        offsets = [0]
        for size in shard_sizes:
            offsets.append(offsets[-1] + size)
        self.shard_slices = {sid: slice(offsets[i], offsets[i + 1]) for i, sid in enumerate(shard_ids)}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded_weight)
            return
        default_weight_loader(param.data[self.shard_slices[shard_id]], loaded_weight)


class QKVLinear(FusedLinear):
    """Fused q/k/v projection: output ``[q (num_heads*head_dim) | k | v (num_kv_heads*head_dim)]``."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        super().__init__(hidden_size, sizes, ("q", "k", "v"), bias)
        self.q_size, self.kv_size = sizes[0], sizes[1]
