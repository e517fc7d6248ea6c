"""The paged KV-cache layout, and the two ways to touch it from PyTorch.

One tensor per layer::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
               ^ 0 = keys, 1 = values

Token ``i`` of a request lives in block ``block_table[i // block_size]`` at offset
``i % block_size``; its flat slot is ``block_id * block_size + offset``. The cache is
allocated uninitialised and never cleared: slots past a request's context may hold anything
(NaN included), and no backend lets them reach an output.

The cache holds the model's dtype, or an FP8 type (``--kv-cache-dtype fp8``, one byte per
element): then a key is stored as ``fp8(key / k_scale)`` and read as ``float(fp8) * k_scale``
(values likewise with ``v_scale``; see ``pagedllm.attention.kv_cache_quant``).
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_cache_quant import dequantize, is_fp8, quantize


def write_to_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Store this step's keys and values in their slots (quantized when the cache is FP8).

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], the model's dtype or FP8.
        key, value: [num_tokens, num_kv_heads, head_dim], the model's dtype.
        slot_mapping: [num_tokens] int64 flat slot indices.
        k_scale, v_scale: FP8 scales (keys are stored as ``key / k_scale``); unused otherwise.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    if is_fp8(kv_cache.dtype):
        # NOTE: index_copy_ has no FP8 kernels; the bytes are copied as uint8.
        key, value = quantize(key, k_scale, kv_cache.dtype), quantize(value, v_scale, kv_cache.dtype)
        kv_cache, key, value = kv_cache.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    """The contexts of a batch, copied out of one half of the cache (dequantized when it is
    FP8), with the slots past each context zeroed.

    Args:
        cache: [num_blocks, block_size, H, D] (``kv_cache[0]`` or ``kv_cache[1]``).
        block_table: [B, nb] int64 block ids.
        valid: [B, L] bool, L <= nb * block_size; True where a position is in the context.
        dtype: the dtype returned (the model's).
        scale: the FP8 cache's ``k_scale`` or ``v_scale``; unused for a cache of ``dtype``.

    Returns:
        [B, H, L, D] of ``dtype`` (a transposed view), zero where ``valid`` is False: the
        attention mask removes those positions, but SDPA adds the mask to the scores and
        weights the values, and NaN + -inf or 0 * NaN would still be NaN.
    """
    batch, num_blocks = block_table.shape
    length = valid.shape[1]
    fp8_dtype = cache.dtype if is_fp8(cache.dtype) else None
    if fp8_dtype is not None:
        cache = cache.view(torch.uint8)
    # NOTE: index_select on the flattened table is several times faster than advanced
    # indexing with a 2-D index on CPU.
    gathered = cache.index_select(0, block_table.reshape(-1))
    context = gathered.view(batch, num_blocks * cache.shape[1], *cache.shape[2:])[:, :length]
    if fp8_dtype is not None:
        context = dequantize(context.view(fp8_dtype), scale, dtype)
    context.masked_fill_(~valid[:, :, None, None], 0)
    return context.transpose(1, 2)
