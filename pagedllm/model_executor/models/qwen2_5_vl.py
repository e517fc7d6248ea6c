"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a vision transformer over the image's
patches, a patch merger to the language model's width and a Qwen2 language model with
multimodal RoPE, as transformers' ``modeling_qwen2_5_vl`` (our own code, on the shared layers).

The vision tower (``Qwen2_5_VisionTransformer``), for an image of ``grid_thw`` (t, h, w)
patches (the processor's ``pixel_values`` [t * h * w, C * temporal_patch * patch^2]):

    x = patch_embed(pixel_values)                           # Conv3d as a matmul: [P, D]
    x = x in window order (``window_index``)                # windows of window_size pixels
    per block: x = x + proj(attn(norm1(x)))                 # within its window, or the whole
               x = x + mlp(norm2(x))                        # image in ``fullatt_block_indexes``
    out = merger(x)[reverse window order]                   # 2 x 2 patches -> one [out_hidden]

attention rotated by a 2-D RoPE on each patch's (row, column). The image fills
``t * h * w / spatial_merge_size^2`` placeholder tokens (``image_token_id``), and its tokens'
three positions (t, h, w) are ``get_mrope_input_positions``' (transformers' ``get_rope_index``).
A video (``pixel_values_videos`` of ``video_grid_thw``, t temporal patches) runs through the
same tower, each frame group attending within itself; its tokens' t position steps by
``tokens_per_second * second_per_grid_ts`` per temporal patch (Qwen2.5-VL).

Checkpoint names of transformers 4 (``model.*``, ``visual.*``) and 5 (``model.language_model.*``,
``model.visual.*``) both load.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedllm.arch_config import get_rope_parameters
from pagedllm.distributed import get_pp_group
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.rotary_embedding import MRotaryEmbedding
from pagedllm.model_executor.models.llama import LlamaModel, Qwen2ForCausalLM
from pagedllm.model_executor.utils import default_weight_loader, renamed_by_prefix

#: Checkpoint name prefixes -> ours (the first that matches renames).
_RENAMED_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
    ("model.", "language_model.model."),
)


def renamed(name: str) -> str:
    """Our parameter name of a Qwen-VL checkpoint tensor (either transformers generation)."""
    return renamed_by_prefix(name, _RENAMED_PREFIXES)


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` of a config or its dict."""
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


# ---------------------------------------------------------------------------- positions


def mrope_input_positions(num_tokens: int, images: Sequence[tuple], spatial_merge_size: int
                          ) -> tuple[np.ndarray, int]:
    """The three RoPE positions (t, h, w) of each prompt token, as transformers' Qwen-VL
    ``get_rope_index``: text tokens count on from the last position on all rows; an image's
    (video's) ``t x h' x w'`` tokens (h' = h / merge, w' = w / merge) sit at start + their
    (int(frame x time_interval), row, column), and the text after it continues from
    start + max(h', w').

    Args:
        num_tokens: the prompt's length.
        images: (offset, length, grid_thw[, time_interval]) of each item's placeholder run, in
            prompt order; ``time_interval`` (default 1) is a video's t step per temporal patch
            (float32 product truncated, as transformers).
        spatial_merge_size: the vision config's.

    Returns:
        (positions [3, num_tokens] int64, ``mrope_position_delta``: the position of token
        ``num_tokens + k`` is ``num_tokens + k + delta`` on every row).

    Raises:
        ValueError: an image whose run does not hold its grid's tokens.
    """
    rows, current, end = [], 0, 0
    for offset, length, (t, h, w), *interval in images:
        text = offset - end
        rows.append(np.broadcast_to(np.arange(text, dtype=np.int64) + current, (3, text)))
        current += text
        grid_h, grid_w = h // spatial_merge_size, w // spatial_merge_size
        if t * grid_h * grid_w != length:
            raise ValueError(f"an image of grid {(t, h, w)} fills {t * grid_h * grid_w} tokens, not {length}")
        steps = (np.arange(t, dtype=np.float32) * np.float32(interval[0] if interval else 1)).astype(np.int64)
        tt, hh, ww = np.meshgrid(steps, np.arange(grid_h), np.arange(grid_w), indexing="ij")
        rows.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]).astype(np.int64) + current)
        current += max(grid_h, grid_w)
        end = offset + length
    rows.append(np.broadcast_to(np.arange(num_tokens - end, dtype=np.int64) + current, (3, num_tokens - end)))
    positions = np.concatenate(rows, axis=1)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


class MRopePositionsMixin:
    """``get_mrope_input_positions`` of a Qwen-VL model (needs ``spatial_merge_size`` and
    ``tokens_per_second``, the vision config's, for videos with ``second_per_grid_ts``)."""

    spatial_merge_size: int
    tokens_per_second: float

    def get_mrope_input_positions(self, prompt_token_ids: Sequence[int], mm_features: Sequence[Any]
                                  ) -> tuple[np.ndarray, int]:
        """(positions [3, P] int64, ``mrope_position_delta``) of a prompt of P tokens with its
        images and videos (``MultiModalFeatureSpec``, each with its ``image_grid_thw`` or
        ``video_grid_thw``, a Qwen2.5-VL video with ``second_per_grid_ts``); plain positions on
        every row for a text-only prompt (see ``mrope_input_positions``)."""
        items = []
        for f in mm_features:
            grid = f.data["image_grid_thw" if "image_grid_thw" in f.data else "video_grid_thw"].to_tensor()[0].tolist()
            item = (f.mm_position.offset, f.mm_position.length, grid)
            if "second_per_grid_ts" in f.data:
                seconds = f.data["second_per_grid_ts"].to_tensor().to(torch.float32)[0]
                item += (float(torch.tensor(self.tokens_per_second, dtype=torch.float32) * seconds),)
            items.append(item)
        return mrope_input_positions(len(prompt_token_ids), items, self.spatial_merge_size)


# ---------------------------------------------------------------------------- vision tower


def vision_rotary_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The 2-D RoPE's frequencies [head_dim / 4] float32 (the same for rows and columns)."""
    spatial = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))


def merge_block_coords(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) [h * w] int64 of one frame's patches in merge-block order (each
    ``merge`` x ``merge`` block of patches consecutive, blocks row by row): the order in which
    the processor writes an image's patches."""
    def blocked(grid: torch.Tensor) -> torch.Tensor:
        return grid.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()

    return blocked(torch.arange(h)[:, None].expand(h, w)), blocked(torch.arange(w)[None, :].expand(h, w))


def vision_rotary_cos_sin(grid_thw: Sequence[int], merge: int, inv_freq: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, head_dim] float32 of one image's patches in merge-block order
    (``merge_block_coords``): the angles of (row, column), [row; column] then repeated."""
    t, h, w = grid_thw
    rows, cols = merge_block_coords(h, w, merge)
    freqs = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1).repeat(t, 1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_vision(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, heads, head_dim] rotated (neox halves) in float32, back in x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment of ``cu_seqlens`` (an image, or a window),
    q / k rotated by the 2-D RoPE; the checkpoint's fused ``qkv`` ([q; k; v], with bias) loads
    into ``qkv`` by parts, ``proj`` after."""

    def __init__(self, dim: int, num_heads: int, prefix: str) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.qkv = QKVParallelLinear(dim, self.head_dim, num_heads, bias=True, prefix=f"{prefix}.qkv")
        self.num_heads = self.qkv.num_heads
        self.proj = RowParallelLinear(dim, dim, bias=True, prefix=f"{prefix}.proj")

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [P, D] -> [P, D]."""
        num_patches = x.shape[0]
        q, k, v = (t.reshape(num_patches, self.num_heads, self.head_dim)
                   for t in self.qkv(x).split(self.qkv.q_size, dim=-1))
        q, k = rotate_vision(q, cos, sin), rotate_vision(k, cos, sin)
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            # NOTE: [1, heads, L, head_dim]: SDPA's CPU flash kernel takes 4-D inputs only (3-D
            # ones fall back to its float32-upcasting math path, several times slower).
            seg = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
            out[start:end] = F.scaled_dot_product_attention(*seg, is_causal=False)[0].transpose(0, 1)
        return self.proj(out.reshape(num_patches, -1))


class VisionGatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), every projection with bias (Qwen2.5-VL's)."""

    def __init__(self, dim: int, hidden: int, act: str, prefix: str) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(dim, hidden, bias=True, prefix=f"{prefix}.gate_proj")
        self.up_proj = ColumnParallelLinear(dim, hidden, bias=True, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(hidden, dim, bias=True, prefix=f"{prefix}.down_proj")
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5_VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); a variant overrides ``make_norm`` (here
    RMSNorms of eps 1e-6) and ``mlp_cls`` (``(dim, hidden, act, prefix)``)."""

    mlp_cls: type[nn.Module] = VisionGatedMLP

    @staticmethod
    def make_norm(dim: int) -> nn.Module:
        return RMSNorm(dim, 1e-6)

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        dim = config_value(config, "hidden_size")
        self.norm1 = self.make_norm(dim)
        self.norm2 = self.make_norm(dim)
        self.attn = VisionAttention(dim, config_value(config, "num_heads"), f"{prefix}.attn")
        self.mlp = self.mlp_cls(dim, config_value(config, "intermediate_size"), config_value(config, "hidden_act"),
                                f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VLPatchMerger(nn.Module):
    """ln_q over each patch, then each block of ``merge^2`` patches concatenated through
    mlp.0 / GELU / mlp.2: [P, D] -> [P / merge^2, out_hidden]."""

    def __init__(self, out_dim: int, dim: int, merge: int, prefix: str) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.ModuleList([
            ColumnParallelLinear(self.hidden, self.hidden, bias=True, prefix=f"{prefix}.mlp.0"),
            nn.GELU(),
            RowParallelLinear(self.hidden, out_dim, bias=True, prefix=f"{prefix}.mlp.2"),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, act, fc2 = self.mlp
        return fc2(act(fc1(self.ln_q(x).view(-1, self.hidden))))


def window_index(grid_thw: Sequence[int], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """One image's merge blocks in window order (windows of ``window`` x ``window`` blocks, row
    by row; partial windows at the right and bottom edges) and the windows' cumulative patch
    counts [0, ...], as transformers' ``get_vision_window_index``."""
    t, h, w = grid_thw
    bh, bw = h // merge, w // merge
    order, bounds = [], [0]
    blocks = torch.arange(t * bh * bw).reshape(t, bh, bw)
    for frame in range(t):
        for r in range(0, bh, window):
            for c in range(0, bw, window):
                ids = blocks[frame, r : r + window, c : c + window].flatten()
                order.append(ids)
                bounds.append(bounds[-1] + len(ids) * merge * merge)
    return torch.cat(order), bounds


class PatchEmbedding(nn.Module):
    """A Conv3d whose stride is its kernel (each patch seen once) as one matmul over the
    flattened patches: pixel_values [P, C * kt * kh * kw] (each patch's pixels in (channel,
    frame, row, column) order: the processor's ``pixel_values``) -> [P, out_channels] in the
    weights' dtype.

    ``weight`` keeps the Conv3d's shape [out_channels, C, kt, kh, kw] (and ``bias``
    [out_channels] when ``bias``), so a transformers checkpoint's ``patch_embed.proj.*`` loads
    as it is; the matmul reads it as [out_channels, C * kt * kh * kw], a view.
    NOTE: the same products as the convolution, summed in another order; on CPU the
    convolution (mkldnn) takes about 15x the matmul's time at Qwen-VL's shapes.

    Args:
        in_channels: C.
        out_channels: the embedding width.
        kernel: (kt, kh, kw).
        bias: whether there is a ``bias``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel: Sequence[int], bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, *kernel))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.weight.reshape(self.weight.shape[0], -1)
        return F.linear(pixel_values.to(weight.dtype).reshape(-1, weight.shape[1]), weight, self.bias)


class QwenVisionTower(nn.Module):
    """What the Qwen-VL vision towers share: the patch embedding (``PatchEmbedding``: the
    checkpoint's Conv3d over each patch, as a matmul; ``patch_bias``), the 2-D RoPE's
    frequencies and the blocks (``block_cls``); a variant adds its mergers and ``forward``.

    Args:
        config: the vision config (or its dict).
    """

    block_cls: type[nn.Module] = Qwen2_5_VisionBlock
    patch_bias = False

    def __init__(self, config: Any, prefix: str = "visual") -> None:
        super().__init__()
        self.dim = config_value(config, "hidden_size")
        self.num_heads = config_value(config, "num_heads")
        self.in_channels = config_value(config, "in_channels", 3)
        self.patch_size = config_value(config, "patch_size")
        self.temporal_patch_size = config_value(config, "temporal_patch_size")
        self.merge = config_value(config, "spatial_merge_size")
        kernel = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = PatchEmbedding(self.in_channels, self.dim, kernel, self.patch_bias)
        theta = (config_value(config, "rope_parameters") or {}).get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", vision_rotary_inv_freq(self.dim // self.num_heads, theta), persistent=False)
        self.blocks = nn.ModuleList(self.block_cls(config, f"{prefix}.blocks.{i}")
                                    for i in range(config_value(config, "depth")))

    def embed_patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[P, C * temporal_patch * patch^2] -> [P, D] in the weights' dtype."""
        return self.patch_embed.proj(pixel_values)


class Qwen2_5_VisionTransformer(QwenVisionTower):
    """The vision tower (see the module docstring).

    Args:
        config: a ``Qwen2_5_VLVisionConfig`` (or its dict).
    """

    def __init__(self, config: Any, prefix: str = "visual") -> None:
        super().__init__(config, prefix)
        self.window_size = config_value(config, "window_size")
        self.fullatt_block_indexes = tuple(config_value(config, "fullatt_block_indexes"))
        self.merger = Qwen2_5_VLPatchMerger(config_value(config, "out_hidden_size"), self.dim, self.merge,
                                            f"{prefix}.merger")

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[int]) -> torch.Tensor:
        """One image's patches [t * h * w, C * temporal_patch * patch^2] of ``grid_thw`` (t, h, w)
        -> its embeddings [t * h * w / merge^2, out_hidden]."""
        unit = self.merge * self.merge
        order, window_bounds = window_index(grid_thw, self.merge, self.window_size // self.merge // self.patch_size)
        x = self.embed_patches(pixel_values)
        num_patches = x.shape[0]
        x = x.view(-1, unit, self.dim)[order].view(num_patches, self.dim)
        cos, sin = (t.view(-1, unit, t.shape[-1])[order].view(num_patches, -1)
                    for t in vision_rotary_cos_sin(grid_thw, self.merge, self.inv_freq))
        frame = grid_thw[1] * grid_thw[2]
        whole = list(range(0, num_patches + 1, frame))
        for i, block in enumerate(self.blocks):
            x = block(x, whole if i in self.fullatt_block_indexes else window_bounds, cos, sin)
        return self.merger(x)[torch.argsort(order)]


# ---------------------------------------------------------------------------- the model


class MRopeLlamaModel(LlamaModel):
    """A Qwen decoder stack rotating by ``MRotaryEmbedding`` (``mrope_section`` of the rope
    parameters; ``mrope_interleaved`` class attribute: Qwen3-VL's layout)."""

    mrope_interleaved = False

    def rotary_embeddings(self, config: PretrainedConfig) -> tuple[list[nn.Module], list[int]]:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = get_rope_parameters(config)
        section = params.get("mrope_section")
        if section is None:
            raise ValueError("rope_parameters has no mrope_section (a Qwen-VL text config has one).")
        table = MRotaryEmbedding(head_dim, config.max_position_embeddings, params["rope_theta"], params, list(section),
                                 self.mrope_interleaved)
        return [table], [0] * config.num_hidden_layers


class _Qwen2MRopeForCausalLM(Qwen2ForCausalLM):
    model_cls = MRopeLlamaModel


class Qwen2_5_VLForConditionalGeneration(MRopePositionsMixin, nn.Module):
    """Images and text in, text out: ``Qwen2ForCausalLM``'s interface (positions [3, T] or
    [T]) plus the image path (``get_multimodal_embeddings``) and the prompt positions
    (``get_mrope_input_positions``). The Qwen-VL family's base: a variant sets ``vision_cls``
    (its tower, ``(vision_config)``) and ``language_cls`` (its language model).

    Args:
        config: the language model's config with the vision keys carried onto it
            (``pagedllm.arch_config.language_model_config``).
        quant_config: the language model's linear layers' method (the vision path is unquantized).
    """

    #: The inputs ``get_multimodal_embeddings`` takes, per image or video (``pagedllm.multimodal.processing``;
    #: an item carries those of its modality).
    mm_input_names = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    vision_cls: type[nn.Module] = Qwen2_5_VisionTransformer
    language_cls: type[nn.Module] = _Qwen2MRopeForCausalLM

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        self.config = config
        if get_pp_group().world_size > 1:
            raise ValueError(f"{config.architectures[0]} does not run with pipeline parallelism.")
        self.spatial_merge_size = config_value(config.vision_config, "spatial_merge_size")
        self.tokens_per_second = config_value(config.vision_config, "tokens_per_second", 1)
        self.visual = self.vision_cls(config.vision_config)
        self.language_model = self.language_cls(config, quant_config)

    def get_multimodal_embeddings(self, pixel_values: Optional[torch.Tensor] = None,
                                  image_grid_thw: Optional[torch.Tensor] = None,
                                  pixel_values_videos: Optional[torch.Tensor] = None,
                                  video_grid_thw: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One image's ``pixel_values`` [P, C * temporal_patch * patch^2] and ``image_grid_thw``
        [1, 3] (or one video's ``pixel_values_videos`` and ``video_grid_thw``) -> its embeddings
        [1, P / merge^2, width] (model dtype; width: the vision tower's output, ``hidden`` here).

        Raises:
            ValueError: neither an image's inputs nor a video's."""
        if pixel_values is not None and image_grid_thw is not None:
            return self.visual(pixel_values, image_grid_thw[0].tolist())[None]
        if pixel_values_videos is not None and video_grid_thw is not None:
            return self.visual(pixel_values_videos, video_grid_thw[0].tolist())[None]
        raise ValueError("get_multimodal_embeddings takes an image's pixel_values and image_grid_thw, or a video's "
                         "pixel_values_videos and video_grid_thw.")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the language model's token embeddings [T, hidden]."""
        return self.language_model.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        intermediate_tensors: Optional[dict[str, torch.Tensor]] = None, inputs_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """As ``LlamaForCausalLM.forward``, positions [3, T] (or [T]); ``inputs_embeds``
        [T, hidden] (the images' embeddings merged in) replaces the embedding of ``input_ids``."""
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a Qwen-VL checkpoint (either naming: ``renamed``): ``language_model.*`` to the
        language model's ``load_weights``, the rest to the vision tower
        (``load_vision_weights``); returns the parameter names loaded.

        Raises:
            ValueError: a tensor with no matching parameter, or a shape mismatch.
        """
        language, vision = [], []
        for name, tensor in weights:
            name = renamed(name)
            if name.startswith("language_model."):
                language.append((name[len("language_model."):], tensor))
            else:
                vision.append((name, tensor))
        loaded = {f"language_model.{n}" for n in self.language_model.load_weights(language)}
        return loaded | load_vision_weights(self, vision)


def load_vision_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load the vision tower's tensors (``visual.*``, by their names): each fused ``attn.qkv``
    into its q / k / v parts, the others whole, through each parameter's ``weight_loader``
    (this rank's part). Returns the names loaded.

    Raises:
        ValueError: a tensor with no matching parameter, or a shape mismatch.
    """
    params = dict(model.named_parameters())
    loaded = set()
    for name, tensor in weights:
        param = params.get(name)
        if param is None:
            raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}.")
        loader = getattr(param, "weight_loader", None)
        if ".attn.qkv." in name:
            for shard, part in zip("qkv", tensor.chunk(3, dim=0)):
                loader(param, part, shard)
        elif loader is None:
            default_weight_loader(param, tensor)
        else:
            loader(param, tensor)
        loaded.add(name)
    return loaded

