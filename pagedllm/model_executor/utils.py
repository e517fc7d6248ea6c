"""Helpers for the parameters layers register: attributes the loader reads, and copying a
checkpoint tensor (or this rank's part of it) into one."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


def set_weight_attrs(weight: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loader attributes (``weight_loader``, ``input_dim``, ``output_dim`` ...) to a
    parameter.

    Raises:
        ValueError: if the parameter already has one of them.
    """
    for key, value in attrs.items():
        if hasattr(weight, key):
            raise ValueError(f"Parameter already has attribute {key!r}.")
        setattr(weight, key, value)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param`` (casting dtype).

    Raises:
        ValueError: if the shapes differ.
    """
    if param.shape != loaded_weight.shape:
        raise ValueError(f"Checkpoint tensor shape {tuple(loaded_weight.shape)} != parameter shape {tuple(param.shape)}.")
    param.data.copy_(loaded_weight)


def load_weight_part(
    param_data: torch.Tensor, loaded_weight: torch.Tensor, dim: Optional[int], part: int, num_parts: int
) -> None:
    """Copy part ``part`` of ``num_parts`` equal parts of ``loaded_weight`` along ``dim`` into
    ``param_data`` (``dim`` None: all of it).

    Raises:
        ValueError: if the checkpoint tensor is not ``num_parts`` times ``param_data`` along
            ``dim`` or differs in another dimension.
    """
    if dim is not None:
        size = param_data.shape[dim]
        if loaded_weight.shape[dim] != size * num_parts:
            raise ValueError(
                f"Checkpoint tensor shape {tuple(loaded_weight.shape)}: dimension {dim} should be "
                f"{num_parts * size} ({num_parts} rank parts of {size})."
            )
        loaded_weight = loaded_weight.narrow(dim, part * size, size)
    default_weight_loader(param_data, loaded_weight)


def renamed_by_prefix(name: str, prefixes: Sequence[tuple[str, str]]) -> str:
    """``name`` with the first ``(old, new)`` of ``prefixes`` whose ``old`` starts it replaced
    by ``new``; unchanged when none does (a checkpoint's tensor name -> the model's)."""
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name
