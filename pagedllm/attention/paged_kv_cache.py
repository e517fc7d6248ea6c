"""The paged KV-cache layout, and the two ways to touch it from PyTorch.

One tensor per layer::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
               ^ 0 = keys, 1 = values

Token ``i`` of a request lives in block ``block_table[i // block_size]`` at offset
``i % block_size``; its flat slot is ``block_id * block_size + offset``. The cache is
allocated uninitialised and never cleared: slots past a request's context may hold anything
(NaN included), and no backend lets them reach an output.
"""

from __future__ import annotations

import torch


def write_to_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values in their slots.

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim].
        key, value: [num_tokens, num_kv_heads, head_dim], same dtype as the cache.
        slot_mapping: [num_tokens] int64 flat slot indices.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The contexts of a batch, copied out of one half of the cache, with the slots past
    each context zeroed.

    Args:
        cache: [num_blocks, block_size, H, D] (``kv_cache[0]`` or ``kv_cache[1]``).
        block_table: [B, nb] int64 block ids.
        valid: [B, L] bool, L <= nb * block_size; True where a position is in the context.

    Returns:
        [B, H, L, D] (a transposed view), zero where ``valid`` is False: the attention mask
        removes those positions, but SDPA adds the mask to the scores and weights the
        values, and NaN + -inf or 0 * NaN would still be NaN.
    """
    batch, num_blocks = block_table.shape
    length = valid.shape[1]
    # NOTE: index_select on the flattened table is several times faster than advanced
    # indexing with a 2-D index on CPU.
    gathered = cache.index_select(0, block_table.reshape(-1))
    context = gathered.view(batch, num_blocks * cache.shape[1], *cache.shape[2:])[:, :length]
    context.masked_fill_(~valid[:, :, None, None], 0)
    return context.transpose(1, 2)
