"""The attention layer: owns a reference to its layer's KV cache and calls the backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import paged_attention
from pagedllm.attention.metadata import get_forward_context


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention over the layer's KV cache.

    ``kv_cache`` ([2, num_blocks, block_size, num_kv_heads, head_dim]) is bound by the
    model runner after the cache is allocated.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads * head_dim], k and v [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]."""
        num_tokens = q.shape[0]
        out = paged_attention(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            get_forward_context(),
            self.scale,
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)
