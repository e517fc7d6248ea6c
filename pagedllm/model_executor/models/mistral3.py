"""Mistral 3 (``Mistral3ForConditionalGeneration``, Mistral Small 3.x): a Pixtral vision tower,
a projector with a patch merger and a Mistral language model (``LlamaForCausalLM``), as
transformers' ``modeling_mistral3`` (our own code).

An image's embeddings (``get_multimodal_embeddings``): the tower's hidden states at
``vision_feature_layer`` [rows x cols patches, D],
an RMSNorm (the text model's ``rms_norm_eps``), the patch merger (each ``spatial_merge_size``^2
block of patches' features side by side, as ``torch.nn.functional.unfold``, through
``merging_layer``), then ``linear_2(act(linear_1(.)))`` to the language model's width:
(rows / m) x (cols / m) embeddings, row-major. In the prompt they fill the image's [IMG]
tokens; the [IMG_BREAK] ending each row and the [IMG_END] ending the image keep their token
embeddings (the placeholder range's ``is_embed``, ``pagedllm.multimodal.processing``).

The config is the checkpoint's ``text_config`` with the vision keys carried onto it
(``pagedllm.arch_config.language_model_config``). Checkpoint names of transformers 4
(``language_model.model.*``, ``language_model.lm_head.*``, ``vision_tower.*``,
``multi_modal_projector.*``) and 5 (``model.language_model.*``, ``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``lm_head.*``) both load.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PixtralVisionConfig, PretrainedConfig
from transformers.activations import ACT2FN

from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.clip import feature_layer_index
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.llava import ImageTextModel, vision_config_as
from pagedllm.model_executor.models.pixtral import PixtralVisionModel

#: Checkpoint name prefixes -> ours (the first that matches renames).
_RENAMED_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class Mistral3PatchMerger(nn.Module):
    """[rows x cols, D] patch features -> [(rows / m) x (cols / m), D]: each m x m block's
    features (channel-major, as ``unfold``) through ``merging_layer`` (no bias)."""

    def __init__(self, hidden: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = ReplicatedLinear(hidden * merge**2, hidden, bias=False,
                                              prefix="multi_modal_projector.patch_merger.merging_layer")

    def forward(self, features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        grid = features.view(rows, cols, -1).permute(2, 0, 1)[None]
        blocks = nn.functional.unfold(grid, kernel_size=self.merge, stride=self.merge)[0].t()
        return self.merging_layer(blocks.contiguous())


class Mistral3MultiModalProjector(nn.Module):
    """norm, patch merger, linear_2(act(linear_1(.))): [P, D] -> [P / m^2, hidden]."""

    def __init__(self, config: PretrainedConfig, vision: PixtralVisionConfig) -> None:
        super().__init__()
        width = vision.hidden_size
        bias = bool(getattr(config, "multimodal_projector_bias", False))
        self.norm = RMSNorm(width, config.rms_norm_eps)
        self.patch_merger = Mistral3PatchMerger(width, config.spatial_merge_size)
        self.linear_1 = ColumnParallelLinear(width, config.hidden_size, bias=bias, prefix="multi_modal_projector.linear_1")
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = RowParallelLinear(config.hidden_size, config.hidden_size, bias=bias,
                                          prefix="multi_modal_projector.linear_2")

    def forward(self, features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        merged = self.patch_merger(self.norm(features), rows, cols)
        return self.linear_2(self.act(self.linear_1(merged)))


class Mistral3ForConditionalGeneration(ImageTextModel):
    """Images and text in, text out; ``LlamaForCausalLM``'s interface plus the image path.

    Args:
        config: the language model's config with Mistral 3's vision keys (see the module docstring).
        quant_config: the language model's linear layers' method (the vision path is unquantized).

    Raises:
        ValueError: a tower other than Pixtral's, a feature layer outside it (or several: the
            projector's norm and merger take one layer's width, as transformers'), a rope type
            of it other than "axial".
    """

    renamed_prefixes = _RENAMED_PREFIXES

    #: The inputs ``get_multimodal_embeddings`` takes, per image (``pagedllm.multimodal.processing``).
    mm_input_names = ("pixel_values", "image_sizes")

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        self.config = config
        vision = vision_config_as(config, PixtralVisionConfig, "Mistral 3")
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        if len(layers) != 1:
            raise ValueError(f"vision_feature_layer {config.vision_feature_layer!r}: Mistral 3 is built with one "
                             "feature layer (its projector's norm and patch merger take one layer's width).")
        self.vision_tower = PixtralVisionModel(vision, [feature_layer_index(k, vision.num_hidden_layers) for k in layers])
        self.multi_modal_projector = Mistral3MultiModalProjector(config, vision)
        self.language_model = LlamaForCausalLM(config, quant_config)
        #: Pixels a side of one embedding (an image's sides are multiples of it).
        self.token_side = vision.patch_size * config.spatial_merge_size

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H_max, W_max], image_sizes [N, 2] (height, width in pixels) ->
        the images' embeddings [N, E, hidden] (model dtype; images of one call are the same size:
        the model runner passes one at a time), E = (height / token_side) x (width / token_side).

        Raises:
            ValueError: a side that is not a multiple of ``token_side``; images of different sizes.
        """
        embeds = []
        for pixels, (height, width) in zip(pixel_values, image_sizes.tolist()):
            if height % self.token_side or width % self.token_side:
                raise ValueError(f"An image of {height} x {width} pixels is not in whole {self.token_side}-pixel "
                                 "tokens (the processor resizes to them).")
            states = self.vision_tower(pixels[:, :height, :width])
            side = self.vision_tower.patch_size
            embeds.append(self.multi_modal_projector(states[0], height // side, width // side))
        if len({e.shape[0] for e in embeds}) > 1:
            raise ValueError("Mistral 3 embeds images of one size per call (the model runner passes one at a time).")
        return torch.stack(embeds)
