"""A float64 paged-attention reference, one query at a time, written for clarity only."""

from __future__ import annotations

from typing import Optional

import torch


def reference_decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    window: Optional[int] = None, soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """Query b [Hq, D] attends to the first ``seq_lens[b]`` positions of the context that
    ``block_table[b]`` pages in ``kv_cache`` [2, num_blocks, block_size, Hkv, D] (with
    ``window`` W, to the last W of them only; only their blocks are read); scores
    ``scale * q.k``, soft-capped to ``soft_cap * tanh(s / soft_cap)``; ``sinks`` [Hq] a logit
    per head in the softmax's denominator only (transformers' gpt_oss eager attention); with
    ``chunk`` C, to the positions of the query's aligned chunk only (from (n - 1) - (n - 1) % C).
    float64 softmax, returned in the query's dtype, [B, Hq, D]."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        first = 0 if window is None else max(0, n - window)
        if chunk is not None:
            first = (n - 1) - (n - 1) % chunk
        pos = torch.arange(first, n)
        blocks = block_table[b, pos // block_size]
        keys = kv_cache[0, blocks, pos % block_size].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        values = kv_cache[1, blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[b].double(), keys) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        weights = scores.softmax(-1)[:, : len(pos)]
        outs.append(torch.einsum("hn,nhd->hd", weights, values))
    return torch.stack(outs).to(query.dtype)
