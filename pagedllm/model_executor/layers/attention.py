"""The attention layer: holds its backend's impl (chosen once, at construction), a
reference to its layer's KV cache and the cache's FP8 scales, and calls the impl."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from pagedllm.attention.kv_cache_quant import calculate_kv_scales
from pagedllm.attention.metadata import get_forward_context
from pagedllm.attention.selector import get_current_attn_backend

logger = logging.getLogger(__name__)


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention over the layer's KV cache.

    The backend is the one the model is built with (``selector.set_attn_backend``, which
    ``model_loader.get_model``'s ``attn_backend`` sets; the model runner chooses it).
    ``kv_cache`` (the backend's ``get_kv_cache_shape``) is bound by the model runner after
    the cache is allocated.

    Scores are ``scale * q.k`` for any ``scale`` (``head_dim ** -0.5``, Gemma's
    ``query_pre_attn_scalar ** -0.5``, Granite's ``attention_multiplier``). Features (vLLM's
    ``Attention`` arguments; the backend must have each one used, see
    ``AttentionBackend.validate_configuration``):

    - ``sliding_window`` W (tokens; None: the whole context): a query at position i attends
      to keys i - W + 1 .. i only (transformers' ``sliding_window_overlay``). The blocks
      wholly before a query's window do not affect its output (CPU_ATTN never reads them,
      TORCH_SDPA zeroes them once gathered): the KV-cache manager frees them, their
      block-table entries then naming the zeroed null block or a block another request reuses.
    - ``attention_chunk_size`` C (tokens; None: none): chunked local attention, a query at
      position i attends to keys i - i % C .. i only (transformers' ``chunked_overlay``, Llama
      4); as with a window, the blocks of earlier chunks are freed and do not affect it.
    - ``logits_soft_cap`` (None or 0: none): scores become ``cap * tanh(score / cap)``
      before the softmax (Gemma 2's ``attn_logit_softcapping``).
    - ``sinks``: [num_heads] logits (float32; with tensor parallelism this rank's heads),
      one per query head, that join the softmax's denominator only (gpt-oss). The model owns
      the tensor (usually its ``nn.Parameter``, loaded under the model's name); the layer keeps
      a reference as ``self.sinks`` without registering it, and the impl reads it at each
      forward.

    ``kv_cache_group_id``: the layer's KV-cache group (its block table and metadata:
    ``get_forward_context(kv_cache_group_id)``), set by ``bind_kv_caches``; 0 with one group.

    FP8 cache scales (``pagedllm.attention.kv_cache_quant``): the buffers ``k_scale`` /
    ``v_scale`` (float32 scalars, -1 until a checkpoint's scale loads into them) and the
    floats ``k_scale_float`` / ``v_scale_float`` the backends use (1.0 until
    ``init_kv_scales``). With ``calculate_kv_scales`` set, the next forward computes them
    from its keys and values, once.

    Raises:
        RuntimeError: built outside ``selector.set_attn_backend``.
        ValueError: the backend lacks a feature the layer uses; a bad ``sliding_window``,
            ``attention_chunk_size`` or ``logits_soft_cap``; ``sinks`` not a floating tensor of shape [num_heads].
    """

    def __init__(
        self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
        attention_chunk_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        if sinks is not None and (
            not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (num_heads,)
        ):
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a floating-point tensor of shape ({num_heads},) (num_heads), got {shape}.")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size
        self.logits_soft_cap = logits_soft_cap or None
        # NOTE: a plain attribute, not a registered parameter: the model's module owns it.
        object.__setattr__(self, "sinks", sinks)
        self.attn_backend = get_current_attn_backend(
            uses_sliding_window=sliding_window is not None, uses_logits_soft_cap=self.logits_soft_cap is not None,
            has_sinks=sinks is not None, uses_chunked_local_attention=attention_chunk_size is not None,
        )
        self.impl = self.attn_backend.get_impl_cls()(
            num_heads, head_dim, scale, num_kv_heads, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            attention_chunk_size=attention_chunk_size,
        )
        self.kv_cache = torch.empty(0)
        self.kv_cache_group_id = 0
        self.register_buffer("k_scale", torch.tensor(-1.0, dtype=torch.float32))
        self.register_buffer("v_scale", torch.tensor(-1.0, dtype=torch.float32))
        self.k_scale_float = self.v_scale_float = 1.0
        self.calculate_kv_scales = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads * head_dim], k and v [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]."""
        num_tokens = q.shape[0]
        if self.calculate_kv_scales:
            self.set_kv_scales(*calculate_kv_scales(k, v))
            self.calculate_kv_scales = False
        out = self.impl.forward(
            self,
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            get_forward_context(self.kv_cache_group_id),
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Use these FP8 cache scales (stored values are ``x / scale``) from now on."""
        self.k_scale.fill_(k_scale)
        self.v_scale.fill_(v_scale)
        self.k_scale_float, self.v_scale_float = float(k_scale), float(v_scale)


def init_kv_scales(layers: list[Attention], cache_dtype: str, calculate: bool = False) -> None:
    """Settle each layer's FP8 scales after loading, as vLLM's ``BaseKVCacheMethod``: with
    ``cache_dtype`` "auto" 1.0 whatever the checkpoint holds; else the checkpoint's k/v
    scales, one of them for both when only one loaded, 1.0 when neither did (with a
    warning for e4m3, whose range 1.0 may not fit, unless ``calculate``: the first batch
    will set them)."""
    defaulted = 0
    for layer in layers:
        k_scale, v_scale = layer.k_scale.item(), layer.v_scale.item()
        if cache_dtype == "auto" or max(k_scale, v_scale) <= 0:
            defaulted += cache_dtype != "auto"
            k_scale = v_scale = 1.0
        elif min(k_scale, v_scale) <= 0:
            k_scale = v_scale = max(k_scale, v_scale)
        layer.set_kv_scales(k_scale, v_scale)
    if defaulted and cache_dtype != "fp8_e5m2" and not calculate:
        logger.warning(
            "Using KV cache scaling factor 1.0 for fp8_e4m3 in %d of %d layers: the checkpoint has no "
            "k_scale / v_scale for them. Keys or values beyond +-448 saturate; --calculate-kv-scales "
            "computes scales from the first batch.", defaulted, len(layers),
        )


def bind_kv_caches(
    layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    zeroed: bool = False, layer_groups: Optional[list[tuple[int, int]]] = None, zero_null_block: bool = False,
) -> list[torch.Tensor]:
    """Allocate the KV caches of ``layers``, of their backend's ``get_kv_cache_shape`` for
    ``num_blocks`` blocks of ``block_size`` tokens, in ``dtype`` (the model's, or FP8), and
    bind them: one per layer, or with ``layer_groups[i]`` = (KV-cache group, position in
    it) of layer i, one per position, shared by that position's layer of every group (one
    block id is then the same bytes in each group; ``pagedllm.core.kv_cache_interface``).

    NOTE: allocated uninitialised unless ``zeroed`` (memory is committed only
    as blocks are used) and never cleared: no backend lets a slot past a request's
    context reach its output (see ``pagedllm.attention.paged_kv_cache``). With
    ``zero_null_block``, block 0 (the null block of sliding windows) is zeroed, so what a
    backend gathers from it and masks stays finite.

    Returns:
        the caches, in order of first use by ``layers``.
    """
    caches: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        group, position = layer_groups[i] if layer_groups is not None else (0, i)
        if position not in caches:
            shape = layer.attn_backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            cache = caches[position] = torch.empty(shape, dtype=dtype, device=device)
            if zeroed:
                cache.view(torch.uint8).zero_()  # all-zero bytes are 0.0 in every float type
            elif zero_null_block:
                cache.view(torch.uint8)[:, 0].zero_()
        layer.kv_cache = caches[position]
        layer.kv_cache_group_id = group
    return list(caches.values())
