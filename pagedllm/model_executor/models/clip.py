"""CLIP's vision transformer as an image encoder (the vision tower of Llava), as transformers'
``CLIPVisionModel`` (our own code, on the shared tensor-parallel linear layers):

    patches = conv(pixel_values)                       # [N, P, D], P = (image_size / patch_size)^2
    h = pre_layrnorm([class_embedding; patches] + position_embedding)    # [N, 1 + P, D]
    per layer: h = h + out_proj(attn(layer_norm1(h)));  h = h + fc2(act(fc1(layer_norm2(h))))

Bidirectional attention within each image. ``forward`` returns the hidden states *entering*
layer k for the feature layers asked (transformers' ``hidden_states[k]``: 0 is the embeddings
after ``pre_layrnorm``), so the model is built only up to the deepest of them; the layers past
it and ``post_layernorm`` are not built (their checkpoint tensors are skipped, as vLLM's).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn
from transformers.activations import ACT2FN

from pagedllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.models.llama import load_llama_weights


def feature_layer_index(layer: int, num_hidden_layers: int) -> int:
    """transformers' ``hidden_states`` index of ``vision_feature_layer`` ``layer`` (negative
    counts from the end of ``num_hidden_layers + 1`` entries).

    Raises:
        ValueError: outside ``-(num_hidden_layers + 1) .. num_hidden_layers``.
    """
    if not -(num_hidden_layers + 1) <= layer <= num_hidden_layers:
        raise ValueError(f"vision_feature_layer {layer} is outside the vision tower's {num_hidden_layers} layers")
    return layer if layer >= 0 else num_hidden_layers + 1 + layer


class CLIPVisionEmbeddings(nn.Module):
    """Patch embedding (a stride-``patch_size`` convolution without bias), the class token
    first, plus a learned position embedding per token (images of ``image_size`` only)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.image_size, self.patch_size = config.image_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, image_size, image_size] -> [N, 1 + P, D] in the weights' dtype.

        Raises:
            ValueError: another image size (the processor resizes to ``image_size``).
        """
        height, width = pixel_values.shape[-2:]
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"Input image size ({height}*{width}) doesn't match the vision tower's "
                             f"({self.image_size}*{self.image_size}).")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Bidirectional multi-head attention over each image's tokens (scale head_dim ** -0.5),
    q/k/v fused in ``qkv_proj`` (with bias), then ``out_proj``."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, config.num_attention_heads, bias=True,
                                          prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.out_proj = RowParallelLinear(hidden, hidden, bias=True, prefix=f"{prefix}.out_proj")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, S, D] -> [N, S, D]."""
        n, s, _ = hidden.shape
        q, k, v = (x.view(n, s, self.num_heads, self.head_dim).transpose(1, 2)
                   for x in self.qkv_proj(hidden).split(self.qkv_proj.q_size, dim=-1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.out_proj(out.transpose(1, 2).reshape(n, s, -1))


class CLIPMLP(nn.Module):
    """fc2(act(fc1(x))), ``hidden_act`` as transformers' ``ACT2FN`` (CLIP's "quick_gelu")."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True, prefix=f"{prefix}.fc1")
        self.act = ACT2FN[config.hidden_act]
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True, prefix=f"{prefix}.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    """One pre-LN layer: attention and MLP blocks, each after its LayerNorm, each residual."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config, f"{prefix}.self_attn")
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config, f"{prefix}.mlp")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class CLIPEncoder(nn.Module):
    def __init__(self, config: Any, num_layers: int, prefix: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, f"{prefix}.layers.{i}") for i in range(num_layers))


class CLIPVisionModel(nn.Module):
    """The vision tower up to its deepest feature layer (see the module docstring).

    Args:
        config: a ``CLIPVisionConfig`` (or its dict).
        feature_layers: transformers' ``hidden_states`` indices to return (``feature_layer_index``).
    """

    def __init__(self, config: Any, feature_layers: Sequence[int], prefix: str = "vision_tower") -> None:
        super().__init__()
        self.feature_layers = tuple(feature_layers)
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config, max(self.feature_layers), f"{prefix}.encoder")

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [N, C, H, W] -> the hidden states [N, 1 + P, D] of each feature layer, in order."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden] if 0 in self.feature_layers else []
        for i, layer in enumerate(self.encoder.layers, start=1):
            hidden = layer(hidden)
            if i in self.feature_layers:
                states.append(hidden)
        return [states[sorted(set(self.feature_layers)).index(k)] for k in self.feature_layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load CLIP vision tensors named as transformers' ``CLIPVisionTransformer`` (without
        the ``vision_model.`` prefix), skipping the layers not built and ``post_layernorm``;
        returns the parameter names loaded."""
        num_layers = len(self.encoder.layers)

        def built(name: str) -> bool:
            if name.startswith("post_layernorm."):
                return False
            if name.startswith("encoder.layers."):
                return int(name.split(".")[2]) < num_layers
            return name != "embeddings.position_ids"

        return load_llama_weights(self, ((n, t) for n, t in weights if built(n)))
