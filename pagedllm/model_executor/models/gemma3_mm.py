"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a SigLIP vision tower, Gemma 3's
multimodal projector and the Gemma 3 language model (``gemma3``), as transformers'
``modeling_gemma3`` (our own code).

An image's embeddings (``get_multimodal_embeddings``): the tower's last hidden states
[P, D_vision] as a sqrt(P) x sqrt(P) grid, average-pooled to sqrt(mm_tokens_per_image) per
side, ``mm_soft_emb_norm`` (a Gemma RMSNorm), then ``@ mm_input_projection_weight`` to the
language model's width. They replace the image's ``<image_soft_token>`` placeholders unscaled
(the text tokens' embeddings carry Gemma's sqrt(hidden) factor, ``embed_input_ids``).

With pan-and-scan (``do_pan_and_scan``) the processor adds crops of a wide or tall image, each
with its own run of placeholders; each crop is an item of its own
(``pagedllm.multimodal.processing``), encoded as an image.

The image's tokens attend to each other both ways in the language model (transformers'
``token_type_ids`` mask): the architecture is in ``BIDIRECTIONAL_IMAGE_ARCHITECTURES``, so the
model runner passes each image's range to attention and the scheduler never cuts one.

The config is the checkpoint's ``text_config`` with the vision keys carried onto it
(``pagedllm.arch_config.language_model_config``). Checkpoint names of transformers 4
(``language_model.model.*``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*``) and 5
(``model.language_model.*``, ``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*``,
``lm_head.*``) both load.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig, SiglipVisionConfig

from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from pagedllm.model_executor.models.llava import ImageTextModel, vision_config_as
from pagedllm.model_executor.models.siglip import SiglipVisionModel

#: Checkpoint name prefixes -> ours (the first that matches renames).
_RENAMED_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def vision_config_of(config: PretrainedConfig) -> SiglipVisionConfig:
    """Gemma 3's SigLIP vision config (``vision_config_as``).

    Raises:
        ValueError: a vision tower other than SigLIP's.
    """
    return vision_config_as(config, SiglipVisionConfig, "Gemma 3")


class Gemma3MultiModalProjector(nn.Module):
    """[N, P, D_vision] patch states -> [N, mm_tokens_per_image, hidden] (see the module docstring).

    Raises:
        ValueError: ``mm_tokens_per_image`` not a square whose side divides the patch grid's.
    """

    def __init__(self, vision: SiglipVisionConfig, hidden: int, mm_tokens_per_image: int) -> None:
        super().__init__()
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(round(mm_tokens_per_image**0.5))
        if tokens_per_side**2 != mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {mm_tokens_per_image} is not a square grid that pools the vision "
                             f"tower's {self.patches_per_side} x {self.patches_per_side} patches evenly.")
        self.kernel_size = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, hidden), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        n, _, width = states.shape
        grid = states.transpose(1, 2).reshape(n, width, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel_size, self.kernel_size).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(states)


class Gemma3LanguageModel(Gemma3ForCausalLM):
    """Gemma 3's text model inside the image-text class."""

    final_soft_cap = False  # transformers' image-text class does not apply final_logit_softcapping


class Gemma3ForConditionalGeneration(ImageTextModel):
    """Images and text in, text out; ``LlamaForCausalLM``'s interface plus the image path.

    Args:
        config: the language model's config with Gemma 3's vision keys (see the module docstring).
        quant_config: the language model's linear layers' method (the vision path is unquantized).

    Raises:
        ValueError: a tower other than SigLIP's, a ``mm_tokens_per_image`` that does not pool
            its patch grid.
    """

    renamed_prefixes = _RENAMED_PREFIXES

    #: The inputs ``get_multimodal_embeddings`` takes, per image (``pagedllm.multimodal.processing``).
    mm_input_names = ("pixel_values",)

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        self.config = config
        vision = vision_config_of(config)
        self.vision_tower = SiglipVisionModel(vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(vision, config.hidden_size, config.mm_tokens_per_image)
        self.language_model = Gemma3LanguageModel(config, quant_config)
        #: Embeddings (placeholder tokens) of one image.
        self.num_image_tokens = config.mm_tokens_per_image

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H, W] -> the images' embeddings [N, mm_tokens_per_image, hidden] (model dtype)."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        return self.multi_modal_projector(self.vision_tower(pixel_values.to(dtype)))
