"""The attention layer: holds its backend's impl (chosen once, at construction) and a
reference to its layer's KV cache, and calls the impl."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import get_forward_context
from pagedllm.attention.selector import get_current_attn_backend


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention over the layer's KV cache.

    The backend is the one the model runner selected (``selector.set_attn_backend`` around
    model loading), else the automatic choice for ``head_dim`` and the default dtype.
    ``kv_cache`` (the backend's ``get_kv_cache_shape``) is bound by the model runner after
    the cache is allocated.

    Raises:
        ValueError: no attention backend can run (see ``selector.get_attn_backend``).
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.attn_backend = get_current_attn_backend(head_dim, torch.get_default_dtype())
        self.impl = self.attn_backend.get_impl_cls()(num_heads, head_dim, scale, num_kv_heads)
        self.kv_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads * head_dim], k and v [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]."""
        num_tokens = q.shape[0]
        out = self.impl.forward(
            self,
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            get_forward_context(),
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)


def bind_kv_caches(
    layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    initial: float | None = None,
) -> list[torch.Tensor]:
    """Allocate one KV cache per layer, of its backend's ``get_kv_cache_shape`` for
    ``num_blocks`` blocks of ``block_size`` tokens, and bind it to the layer.

    NOTE: allocated uninitialised unless ``initial`` is given (memory is committed only
    as blocks are used) and never cleared: no backend lets a slot past a request's
    context reach its output (see ``pagedllm.attention.paged_kv_cache``).

    Returns:
        the caches, in ``layers`` order.
    """
    caches = []
    for layer in layers:
        shape = layer.attn_backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        cache = torch.empty(shape, dtype=dtype, device=device)
        if initial is not None:
            cache.fill_(initial)
        layer.kv_cache = cache
        caches.append(cache)
    return caches
