"""The tensor-parallel group: its size, this process's rank in it, and its collectives.

Today the group is this one process: size 1, rank 0, and the collectives return their
input. Tensor parallelism will make ``initialize_model_parallel`` accept sizes above 1 (one
process per rank joined by ``torch.distributed``) and the collectives communicate; the
layers already shard by ``get_tensor_model_parallel_rank`` / ``_world_size``.
"""

from __future__ import annotations

import torch

_tp_world_size = 1
_tp_rank = 0


def initialize_model_parallel(tensor_model_parallel_size: int = 1) -> None:
    """Set up the tensor-parallel group of ``tensor_model_parallel_size`` processes.

    Raises:
        ValueError: for a size below 1.
        NotImplementedError: for a size above 1 (tensor parallelism is not supported yet).
    """
    global _tp_world_size, _tp_rank
    if tensor_model_parallel_size < 1:
        raise ValueError(f"tensor_model_parallel_size must be at least 1, got {tensor_model_parallel_size}.")
    if tensor_model_parallel_size > 1:
        raise NotImplementedError(
            f"tensor_model_parallel_size={tensor_model_parallel_size}: tensor parallelism is not supported yet; use 1."
        )
    _tp_world_size, _tp_rank = 1, 0


def get_tensor_model_parallel_world_size() -> int:
    """Processes in the tensor-parallel group (1 today)."""
    return _tp_world_size


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in the tensor-parallel group, from 0 (0 today)."""
    return _tp_rank


def _require_single_process(op: str) -> None:
    if _tp_world_size != 1:
        raise NotImplementedError(f"{op} over {_tp_world_size} tensor-parallel ranks is not supported yet.")


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks (same shape and dtype): ``x`` itself in a group of one.

    Raises:
        NotImplementedError: in a group of more than one process.
    """
    _require_single_process("all_reduce")
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order: ``x`` itself in a group of one.

    Raises:
        NotImplementedError: in a group of more than one process.
    """
    _require_single_process("all_gather")
    return x
