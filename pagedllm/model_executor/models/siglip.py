"""SigLIP's vision transformer as an image encoder (the vision tower of Gemma 3), as
transformers' ``SiglipVisionModel`` (our own code; the encoder layers are CLIP's, ``clip``):

    patches = conv(pixel_values) + position_embedding       # [N, P, D], P = (image_size / patch_size)^2
    per layer: h = h + out_proj(attn(layer_norm1(h)));  h = h + fc2(act(fc1(layer_norm2(h))))
    out = post_layernorm(h)                                  # transformers' last_hidden_state

No class token and no pre-norm; bidirectional attention within each image. The attention-pooling
head (``vision_use_head``) is not built: Gemma 3 reads the last hidden state (its checkpoint
tensors are skipped).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.model_executor.models.clip import CLIPEncoder
from pagedllm.model_executor.models.llama import load_llama_weights


class SiglipVisionEmbeddings(nn.Module):
    """Patch embedding (a stride-``patch_size`` convolution with bias) plus a learned position
    embedding per patch (images of ``image_size`` only)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.image_size = config.image_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size)
        self.num_positions = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, image_size, image_size] -> [N, P, D] in the weights' dtype.

        Raises:
            ValueError: another image size (the processor resizes to ``image_size``).
        """
        height, width = pixel_values.shape[-2:]
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"Input image size ({height}*{width}) doesn't match the vision tower's "
                             f"({self.image_size}*{self.image_size}).")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    """The vision tower up to ``post_layernorm`` (see the module docstring).

    Args:
        config: a ``SiglipVisionConfig``.
    """

    def __init__(self, config: Any, prefix: str = "vision_tower") -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = CLIPEncoder(config, config.num_hidden_layers, f"{prefix}.encoder")
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H, W] -> the last hidden states [N, P, D]."""
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load SigLIP vision tensors named as transformers' ``SiglipVisionTransformer``
        (without the ``vision_model.`` prefix), skipping the pooling ``head``; returns the
        parameter names loaded.

        Raises:
            ValueError: a tensor with no matching parameter, or a shape mismatch.
        """
        return load_llama_weights(self, ((n, t) for n, t in weights
                                         if not n.startswith("head.") and n != "embeddings.position_ids"))
