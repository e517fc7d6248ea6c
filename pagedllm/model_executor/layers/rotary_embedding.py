"""Rotary position embeddings (RoFormer, Su et al. 2021, arXiv:2104.09864), "neox" layout
(the two halves of the head dimension rotate together), as HF Llama/Qwen apply them.

``rope_scaling`` of type ``llama3`` rescales the inverse frequencies by wavelength
(Llama 3.1; formula as in HF ``_compute_llama3_parameters``).

``RotaryEmbedding`` is a ``CustomOp``: on CPU the C++ kernel rotates queries and keys in
place; elsewhere (and without the kernels) PyTorch returns new tensors.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.custom_op import CustomOp


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def get_rope_parameters(config) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope scaling dict or None) of an HF config.

    transformers >= 5 keeps both in ``config.rope_parameters``; earlier versions have
    ``config.rope_theta`` and ``config.rope_scaling``.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    return float(theta), (None if rope_type == "default" else params)


class RotaryEmbedding(CustomOp):
    """Applies RoPE to queries and keys given each token's position: ``cos_sin(positions)``
    once per forward pass, then ``self(query, key, cos, sin)`` in every layer.

    Args:
        head_dim: rotary dimension (the full head dimension).
        max_position: largest position + 1 (tokens).
        base: ``rope_theta``.
        rope_scaling: HF config ``rope_scaling`` dict or None; types "default" and "llama3".

    Raises:
        ValueError: for an unsupported ``rope_scaling`` type.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: Optional[dict] = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)  # type: ignore[arg-type]
        elif rope_type != "default":
            raise ValueError(f"Unsupported rope_scaling type {rope_type!r}; supported: default, llama3.")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos and sin of each position, halves repeated (neox layout).
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [T, 1, head_dim] in ``dtype``, for positions [T] (int64).

        Computed once per forward pass and shared by every layer.
        """
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def forward_native(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` [T, Hq, D] and ``key`` [T, Hkv, D] by ``cos_sin``'s cos/sin: new tensors."""
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def forward_cpu(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``forward_native``, by the C++ kernel in place (``query`` and ``key`` may be
        views of the fused qkv output), returning them."""
        cpu_kernels.rotary_embedding(query, key, cos.squeeze(1), sin.squeeze(1))
        return query, key


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
