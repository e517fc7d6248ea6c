"""Copies between a request's slots in a paged KV cache and a contiguous tensor.

The two cache layouts of pagedllm's attention backends (``get_kv_cache_shape``):
``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys, values) and MLA's
``[num_blocks, block_size, head_size]``. Token i of a request lives at slot
``block_ids[i // block_size] * block_size + i % block_size``; a copy's tensor holds
the request's tokens in order, ``[2, num_tokens, num_kv_heads, head_size]`` or
``[num_tokens, head_size]``, whatever the block size.
"""

from __future__ import annotations

import torch


def _flat_slots(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` viewed with its block and offset dimensions merged into one slot dimension."""
    block_dim = 1 if cache.dim() == 5 else 0
    return cache.flatten(block_dim, block_dim + 1)


def token_slots(block_ids: list[int], num_tokens: int, block_size: int, device: torch.device) -> torch.Tensor:
    """The slots of a request's first ``num_tokens`` tokens (int64, [num_tokens])."""
    positions = torch.arange(num_tokens, device=device)
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)[positions // block_size]
    return blocks * block_size + positions % block_size


def gather_tokens(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of the KV at ``slots`` (``token_slots``)."""
    flat = _flat_slots(cache)
    return flat[:, slots] if cache.dim() == 5 else flat[slots]


def scatter_tokens(cache: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Write ``tokens`` (``gather_tokens``' shape) into the cache at ``slots``.

    Raises:
        ValueError: ``tokens`` of another shape or dtype than the slots take.
    """
    flat = _flat_slots(cache)
    expected = (flat.shape[0], len(slots), *flat.shape[2:]) if cache.dim() == 5 else (len(slots), *flat.shape[1:])
    if tuple(tokens.shape) != expected or tokens.dtype != cache.dtype:
        raise ValueError(f"KV of shape {tuple(tokens.shape)} {tokens.dtype} does not fit this cache's slots "
                         f"({expected} {cache.dtype}): the two engines must serve the same model, dtype, "
                         "KV-cache dtype and parallel sizes.")
    if cache.dim() == 5:
        flat[:, slots] = tokens.to(cache.device)
    else:
        flat[slots] = tokens.to(cache.device)
