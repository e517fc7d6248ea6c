"""Each request's slot in a state cache, as the ops take it."""

from __future__ import annotations

from typing import Optional

import torch


def slot_indices(indices: Optional[torch.Tensor], num_reqs: int, device: torch.device) -> torch.Tensor:
    """int64 [num_reqs]: ``indices`` (any integer dtype), or slot ``r`` for request ``r`` when
    None.

    Raises:
        ValueError: ``indices`` is not one-dimensional of ``num_reqs`` entries.
    """
    if indices is None:
        return torch.arange(num_reqs, device=device)
    if indices.dim() != 1 or indices.numel() != num_reqs:
        raise ValueError(f"expected {num_reqs} slot indices, got shape {tuple(indices.shape)}")
    return indices.to(device=device, dtype=torch.long)


def kernel_slot_indices(indices: Optional[torch.Tensor], num_reqs: int) -> torch.Tensor:
    """``indices`` as the C++ kernels take them: contiguous int32 or int64 [num_reqs] (no copy
    when they are already), ``arange`` when None.

    Raises:
        ValueError: as ``slot_indices``.
    """
    if indices is None:
        return torch.arange(num_reqs)
    if indices.dim() != 1 or indices.numel() != num_reqs:
        raise ValueError(f"expected {num_reqs} slot indices, got shape {tuple(indices.shape)}")
    if indices.dtype in (torch.int32, torch.int64) and indices.is_contiguous():
        return indices
    return indices.to(torch.long).contiguous()
