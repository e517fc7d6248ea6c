"""Paged attention, portable PyTorch implementation (CPU and CUDA).

KV-cache layout, one tensor per layer::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
               ^ 0 = keys, 1 = values

Token ``i`` of a request lives in block ``block_table[i // block_size]`` at offset
``i % block_size``; its flat slot is ``block_id * block_size + offset``.

Decodes (one query each) are computed together. On CPU, when the C++ kernel of
``pagedllm.kernels.cpu`` is available (built on first use; see that module), it
reads K/V straight from the blocks by block table, threaded over (request, kv head).
Otherwise — CUDA, no compiler, or ``PAGEDLLM_DISABLE_CPU_KERNELS=1`` — the portable path
gathers the context from the cache by block table into a padded [num_decodes, max_len]
batch masked by sequence length, with the query heads that share a KV head laid along
SDPA's query axis (grouped-query attention without repeating K/V); it is also the
reference the kernel is tested against.

Prefill tokens attend causally to their request's earlier context in the cache and to the
chunk itself. On CPU with the kernel, each prefill token is one more decode query (the
runner gives every token its request's block table and its position + 1 as length; the
chunk's K/V are in the cache by then): 3x PyTorch's CPU flash attention on 128-token
prompts, still faster at 8,192. Otherwise one SDPA call per request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.attention.metadata import AttentionMetadata


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


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, H, D] gathered by [B, nb] -> [B, nb * block_size, H, D]."""
    batch, num_blocks = block_table.shape
    # NOTE: index_select on the flattened table is several times faster than advanced
    # indexing with a 2-D index on CPU.
    gathered = cache.index_select(0, block_table.reshape(-1))
    return gathered.view(batch, num_blocks * cache.shape[1], *cache.shape[2:])


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    Args:
        query: [num_tokens, num_heads, head_dim].
        key, value: [num_tokens, num_kv_heads, head_dim].
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim].
        metadata: the step's ``AttentionMetadata``.
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [num_tokens, num_heads, head_dim], the dtype of ``query``.
    """
    write_to_kv_cache(kv_cache, key, value, metadata.slot_mapping)
    output = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        _decode_attention(query[:num_decodes], kv_cache, metadata, scale, output[:num_decodes])
    if metadata.num_prefills:
        _prefill_attention(query, key, value, kv_cache, metadata, scale, output)
    return output


def prepare_kernels(device: torch.device) -> bool:
    """Build (first time on this machine, ~15 s) or load the device's native kernels now,
    at engine start-up, rather than in the first request. Returns whether they are used."""
    return device.type == "cpu" and cpu_kernels.is_available()


def _can_use_cpu_kernel(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.stride(-1) == 1 and kv_cache.stride(-1) == 1 and cpu_kernels.is_available()


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention of the decode queries [num_decodes, num_heads, head_dim], into ``out``."""
    if _can_use_cpu_kernel(query, kv_cache):
        cpu_kernels.paged_decode_attention(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            metadata.decode_block_table,
            metadata.decode_seq_lens,
            scale,
        )
        return
    out.copy_(_decode_attention_torch(query, kv_cache, metadata, scale))


def _decode_attention_torch(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The portable decode path (CPU and CUDA); the reference for the CPU kernel."""
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    keys = _gather_context(kv_cache[0], metadata.decode_block_table).transpose(1, 2)
    values = _gather_context(kv_cache[1], metadata.decode_block_table).transpose(1, 2)
    max_len = keys.shape[2]
    valid = torch.arange(max_len, device=query.device)[None, :] < metadata.decode_seq_lens[:, None]
    # The slots past a context hold whatever the block last held (or block-table padding):
    # SDPA adds the mask to the scores and weights the values, and NaN + -inf or 0 * NaN
    # would still be NaN.
    stale = ~valid[:, None, :, None]
    keys, values = keys.masked_fill(stale, 0), values.masked_fill(stale, 0)
    q = query.view(num_decodes, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    output: torch.Tensor,
) -> None:
    base = metadata.num_decodes
    if metadata.prefill_token_seq_lens is not None and _can_use_cpu_kernel(query, kv_cache):
        # Each prefill token as a decode query (module docstring).
        assert metadata.prefill_token_block_table is not None
        cpu_kernels.paged_decode_attention(
            output[base:],
            query[base:],
            kv_cache[0],
            kv_cache[1],
            metadata.prefill_token_block_table,
            metadata.prefill_token_seq_lens,
            scale,
        )
        return
    starts = metadata.prefill_query_start_loc
    for i, seq_len in enumerate(metadata.prefill_seq_lens):
        start, end = base + starts[i], base + starts[i + 1]
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        num_queries = end - start
        if seq_len == num_queries:
            k, v = key[start:end], value[start:end]
            mask = None
        else:
            table = metadata.prefill_block_table[i : i + 1]
            k = _gather_context(kv_cache[0], table)[0, :seq_len]
            v = _gather_context(kv_cache[1], table)[0, :seq_len]
            q_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        output[start:end] = out[0].transpose(0, 1)
