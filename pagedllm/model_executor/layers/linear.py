"""Linear layers whose parameters know how to load themselves from a checkpoint.

Several checkpoint matrices may be fused into one layer (q/k/v into ``qkv_proj``,
gate/up into ``gate_up_proj``); each parameter carries a ``weight_loader`` that copies a
checkpoint tensor into its shard. Output rows of a fused layer are the shards stacked in
order: ``[q | k | v]`` or ``[gate | up]``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

ShardId = Union[str, int]


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
