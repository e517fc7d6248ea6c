"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): a vision transformer with learned position
embeddings, a patch merger, DeepStack features and a Qwen3 language model with interleaved
multimodal RoPE, as transformers' ``modeling_qwen3_vl`` (our own code, on the shared layers).

The vision tower (``Qwen3VLVisionModel``), for an image of ``grid_thw`` (t, h, w) patches:

    x = patch_embed(pixel_values) + pos_embed resampled to h x w (bilinear, corners aligned)
    per block: x = x + proj(attn(norm1(x)));  x = x + mlp(norm2(x))    # LayerNorms; whole image
    after block d of ``deepstack_visual_indexes``: deepstack_d = deepstack_merger_d(x)
    out = merger(x)                                           # 2 x 2 patches -> one [out_hidden]

with the same 2-D RoPE as Qwen2.5-VL's. ``get_multimodal_embeddings`` returns ``out`` and the
DeepStack features side by side on the channel axis, [tokens, out_hidden x (1 + D)]: the encoder
cache and the runner's merge treat them as one embedding, whose first ``hidden`` channels enter
the language model at the image's placeholder tokens and whose D others are added to the
hidden states of those tokens after decoder layers 0 .. D - 1 (transformers'
``_deepstack_process``). The token embeddings of text (``embed_input_ids``) carry zeros there.
A video arrives as one item per temporal patch (grid (1, h, w), its own run after its
``<t seconds>`` text), encoded as an image; its positions are an image's (transformers' Qwen3-VL
``get_rope_index``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.llama import Qwen3ForCausalLM
from pagedllm.model_executor.models.qwen2_5_vl import (
    MRopeLlamaModel,
    Qwen2_5_VisionBlock,
    Qwen2_5_VLForConditionalGeneration,
    QwenVisionTower,
    config_value,
    merge_block_coords,
    vision_rotary_cos_sin,
)


def bilinear_taps(grid_thw: Sequence[int], side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each patch of one image (merge-block order, frames repeated), the 4 cells of a
    ``side`` x ``side`` position table it reads and their weights: bilinear resampling of the
    table to the image's h x w grid with corners aligned (transformers'
    ``get_vision_interpolation_indices_and_weights``). Returns (indices [P, 4] int64, weights
    [P, 4] float32), taps ordered (top-left, top-right, bottom-left, bottom-right)."""
    t, h, w = grid_thw
    rows, cols = merge_block_coords(h, w, merge)

    def axis(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
        floor = torch.floor(src)
        offsets = torch.arange(0, 2)
        taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
        weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return taps, weights

    row_taps, row_weights = axis(rows, h)
    col_taps, col_weights = axis(cols, w)
    indices = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return indices.repeat(t, 1), weights.repeat(t, 1)


class Qwen3VLVisionMLP(nn.Module):
    """linear_fc2(act(linear_fc1(x))), with biases."""

    def __init__(self, dim: int, hidden: int, act: str, prefix: str) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(dim, hidden, bias=True, prefix=f"{prefix}.linear_fc1")
        self.act = ACT2FN[act]
        self.linear_fc2 = RowParallelLinear(hidden, dim, bias=True, prefix=f"{prefix}.linear_fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VLVisionBlock(Qwen2_5_VisionBlock):
    """x + attn(norm1(x)), then + mlp(norm2(x)); LayerNorms of eps 1e-6."""

    mlp_cls = Qwen3VLVisionMLP

    @staticmethod
    def make_norm(dim: int) -> nn.Module:
        return nn.LayerNorm(dim, eps=1e-6)


class Qwen3VLPatchMerger(nn.Module):
    """Each block of ``merge^2`` patches concatenated through linear_fc1 / GELU / linear_fc2:
    [P, D] -> [P / merge^2, out_hidden]; the LayerNorm over each patch before the
    concatenation, or over the concatenation (``postshuffle``: the DeepStack mergers)."""

    def __init__(self, dim: int, out_dim: int, merge: int, postshuffle: bool, prefix: str) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else dim, eps=1e-6)
        self.linear_fc1 = ColumnParallelLinear(self.hidden, self.hidden, bias=True, prefix=f"{prefix}.linear_fc1")
        self.act = nn.GELU()
        self.linear_fc2 = RowParallelLinear(self.hidden, out_dim, bias=True, prefix=f"{prefix}.linear_fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden)) if self.postshuffle else self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VLVisionModel(QwenVisionTower):
    """The vision tower (see the module docstring).

    Args:
        config: a ``Qwen3VLVisionConfig`` (or its dict).
    """

    block_cls = Qwen3VLVisionBlock
    patch_bias = True

    def __init__(self, config: Any, prefix: str = "visual") -> None:
        super().__init__(config, prefix)
        out_dim = config_value(config, "out_hidden_size")
        num_positions = config_value(config, "num_position_embeddings")
        self.pos_embed = nn.Embedding(num_positions, self.dim)
        self.num_grid_per_side = int(num_positions**0.5)
        self.merger = Qwen3VLPatchMerger(self.dim, out_dim, self.merge, False, f"{prefix}.merger")
        self.deepstack_visual_indexes = tuple(config_value(config, "deepstack_visual_indexes") or ())
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VLPatchMerger(self.dim, out_dim, self.merge, True, f"{prefix}.deepstack_merger_list.{i}")
            for i in range(len(self.deepstack_visual_indexes)))

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[int]) -> torch.Tensor:
        """One image's patches [t * h * w, C * temporal_patch * patch^2] of ``grid_thw`` ->
        [t * h * w / merge^2, out_hidden x (1 + D)]: the merger's output, then each DeepStack
        merger's, on the channel axis."""
        x = self.embed_patches(pixel_values)
        indices, weights = bilinear_taps(grid_thw, self.num_grid_per_side, self.merge)
        pos = (self.pos_embed(indices.to(x.device)) * weights.to(x.device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = vision_rotary_cos_sin(grid_thw, self.merge, self.inv_freq)
        frame = grid_thw[1] * grid_thw[2]
        whole = list(range(0, x.shape[0] + 1, frame))
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, whole, cos, sin)
            if i in self.deepstack_visual_indexes:
                features.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *features], dim=-1)


class DeepstackLlamaModel(MRopeLlamaModel):
    """Qwen3-VL's decoder stack: interleaved multimodal RoPE, and ``deepstack`` [D, T, hidden]
    (zeros at text tokens) added to the residual stream after layers 0 .. D - 1."""

    mrope_interleaved = True

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        intermediate_tensors: Optional[dict[str, torch.Tensor]] = None, inputs_embeds: Optional[torch.Tensor] = None,
        deepstack: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """As ``LlamaModel.forward`` (one pipeline stage), plus ``deepstack``."""
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        ropes = [table.cos_sin(positions, hidden_states.dtype) for table in self.rotary_embs]
        for i in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[i](ropes[self.layer_rope[i]], hidden_states, residual)
            if deepstack is not None and i < deepstack.shape[0]:
                # The stream as one tensor (transformers' order: the layer's sum, then the features).
                hidden_states, residual = hidden_states + residual + deepstack[i], None
        if residual is None:
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class _Qwen3DeepstackForCausalLM(Qwen3ForCausalLM):
    model_cls = DeepstackLlamaModel


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Images and text in, text out (see the module docstring): Qwen2.5-VL's model with
    Qwen3-VL's vision tower and language model, and the DeepStack features carried beside
    the embeddings.

    Args:
        config: the language model's config with the vision keys carried onto it.
        quant_config: the language model's linear layers' method (the vision path is unquantized).
    """

    vision_cls = Qwen3VLVisionModel
    language_cls = _Qwen3DeepstackForCausalLM

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__(config, quant_config)
        self.hidden_size = config.hidden_size
        self.num_deepstack = len(self.visual.deepstack_visual_indexes)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden x (1 + D)]: the token embeddings, then zeros (no DeepStack
        features at text tokens)."""
        embeds = self.language_model.model.embed_tokens(input_ids)
        return torch.cat([embeds, embeds.new_zeros(embeds.shape[0], self.hidden_size * self.num_deepstack)], dim=-1)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        intermediate_tensors: Optional[dict[str, torch.Tensor]] = None, inputs_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """positions [3, T] (or [T]); ``inputs_embeds`` [T, hidden x (1 + D)] (``embed_input_ids``
        with the images merged in) replaces the embedding of ``input_ids``."""
        deepstack = None
        if inputs_embeds is not None:
            num_tokens = inputs_embeds.shape[0]
            deepstack = inputs_embeds[:, self.hidden_size:].reshape(num_tokens, self.num_deepstack, self.hidden_size)
            inputs_embeds, deepstack = inputs_embeds[:, : self.hidden_size], deepstack.transpose(0, 1)
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds, deepstack)
