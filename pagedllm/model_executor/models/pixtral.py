"""Pixtral's vision transformer as an image encoder (the vision tower of Mistral 3), as
transformers' ``PixtralVisionModel`` (our own code, on the shared tensor-parallel linear layers):

    patches = conv(pixel_values)                  # [P, D], P = (H / patch_size) x (W / patch_size), row-major
    h = ln_pre(patches)                           # RMSNorm
    per layer: h = h + o_proj(attn(attention_norm(h), 2-D rope));  h = h + down(act(gate(x)) * up(x)), x = ffn_norm(h)

Images keep their own size (any multiple of ``patch_size``): no learned position embedding,
but a 2-D rope over the patch grid (``pixtral_rope``). Bidirectional attention within each
image; one image at a time (transformers' block mask over its concatenated images). ``forward``
returns the hidden states *entering* layer k for the feature layers asked (transformers'
``hidden_states[k]``: 0 is ``ln_pre``'s output, -1 the last layer's), so the model is built
only up to the deepest of them (the checkpoint tensors of the layers past it are skipped).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn
from transformers.activations import ACT2FN

from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.models.llama import load_llama_weights

#: transformers' fixed epsilon of every Pixtral RMSNorm.
PIXTRAL_NORM_EPS = 1e-5


def pixtral_rope(rows: int, cols: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D rope of a ``rows`` x ``cols`` patch grid, as transformers'
    ``PixtralVisionRotaryEmbedding``: the head_dim / 2 frequencies theta^(-2i / head_dim), the
    even ones turning with the patch's row, the odd ones with its column, [row | col] repeated
    over both halves of the head (rotate-half layout). Returns (cos, sin) [rows x cols, head_dim]
    float32, patches row-major."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    rows_idx, cols_idx = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    angles = torch.cat([rows_idx.reshape(-1, 1).float() * inv_freq[0::2],
                        cols_idx.reshape(-1, 1).float() * inv_freq[1::2]], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class PixtralAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches (scale head_dim ** -0.5),
    q/k/v fused in ``qkv_proj`` (no bias), rope on q and k, then ``o_proj``."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, config.num_attention_heads, bias=False,
                                          prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.o_proj = RowParallelLinear(hidden, hidden, bias=False, prefix=f"{prefix}.o_proj")

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [P, D], cos / sin [P, head_dim] -> [P, D]."""
        p = hidden.shape[0]
        q, k, v = (x.view(p, self.num_heads, self.head_dim).transpose(0, 1)
                   for x in self.qkv_proj(hidden).split(self.qkv_proj.q_size, dim=-1))
        cos, sin = cos.to(hidden.dtype), sin.to(hidden.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.o_proj(out.transpose(0, 1).reshape(p, -1))


class PixtralMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), gate and up fused in ``gate_up_proj``;
    ``hidden_act`` as transformers' ``ACT2FN`` (Pixtral's "gelu")."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=False,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.act = ACT2FN[config.hidden_act]
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class PixtralAttentionLayer(nn.Module):
    """One pre-norm layer: attention and MLP blocks, each after its RMSNorm, each residual."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, PIXTRAL_NORM_EPS)
        self.attention = PixtralAttention(config, f"{prefix}.attention")
        self.ffn_norm = RMSNorm(config.hidden_size, PIXTRAL_NORM_EPS)
        self.feed_forward = PixtralMLP(config, f"{prefix}.feed_forward")

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attention(self.attention_norm(hidden), cos, sin)
        return hidden + self.feed_forward(self.ffn_norm(hidden))


class PixtralTransformer(nn.Module):
    def __init__(self, config: Any, num_layers: int, prefix: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralAttentionLayer(config, f"{prefix}.layers.{i}") for i in range(num_layers))


class PixtralVisionModel(nn.Module):
    """The vision tower up to its deepest feature layer (see the module docstring).

    Args:
        config: a ``PixtralVisionConfig``.
        feature_layers: transformers' ``hidden_states`` indices to return (``feature_layer_index``).

    Raises:
        ValueError: a rope type other than "axial" (transformers' only one).
    """

    def __init__(self, config: Any, feature_layers: Sequence[int], prefix: str = "vision_tower") -> None:
        super().__init__()
        rope = config.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"The Pixtral vision tower's rope_type {rope['rope_type']!r} is not built (built: 'axial').")
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.patch_size = config.patch_size
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.feature_layers = tuple(feature_layers)
        self.patch_conv = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                    stride=config.patch_size, bias=False)
        self.ln_pre = RMSNorm(config.hidden_size, PIXTRAL_NORM_EPS)
        self.transformer = PixtralTransformer(config, max(self.feature_layers), f"{prefix}.transformer")

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [C, H, W] of one image (H, W multiples of ``patch_size``) -> the hidden
        states [P, D] of each feature layer, in order (P = H / patch_size x W / patch_size, row-major)."""
        grid = self.patch_conv(pixel_values[None].to(self.patch_conv.weight.dtype))[0]
        rows, cols = grid.shape[-2:]
        hidden = self.ln_pre(grid.flatten(1).t().contiguous())
        cos, sin = pixtral_rope(rows, cols, self.head_dim, self.rope_theta)
        cos, sin = cos.to(hidden.device), sin.to(hidden.device)
        states = [hidden] if 0 in self.feature_layers else []
        for i, layer in enumerate(self.transformer.layers, start=1):
            hidden = layer(hidden, cos, sin)
            if i in self.feature_layers:
                states.append(hidden)
        return [states[sorted(set(self.feature_layers)).index(k)] for k in self.feature_layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Pixtral vision tensors named as transformers' ``PixtralVisionModel``, skipping
        the layers not built; returns the parameter names loaded."""
        num_layers = len(self.transformer.layers)

        def built(name: str) -> bool:
            return not name.startswith("transformer.layers.") or int(name.split(".")[2]) < num_layers

        return load_llama_weights(self, ((n, t) for n, t in weights if built(n)))
