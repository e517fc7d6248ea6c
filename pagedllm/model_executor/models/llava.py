"""Llava (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector and a
Llama language model, as transformers' ``modeling_llava`` (our own code).

An image's embeddings (``get_multimodal_embeddings``): the vision tower's hidden states at
``vision_feature_layer`` (a list: those layers' states concatenated on the channel axis),
without the class token under ``vision_feature_select_strategy`` "default" ("full" keeps it),
then ``linear_2(act(linear_1(.)))`` to the language model's width. The model runner puts them
at the image's placeholder tokens (``embed_input_ids`` embeds the rest) and runs the
language model on ``inputs_embeds``.

The config is the checkpoint's ``text_config`` with the vision keys carried onto it
(``pagedllm.arch_config.language_model_config``). Checkpoint names of transformers 4
(``language_model.model.*``, ``vision_tower.vision_model.*``) and 5 (``model.language_model.*``,
``model.vision_tower.*``, ``lm_head.*``) both load.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn
from transformers import CLIPVisionConfig, PretrainedConfig
from transformers.activations import ACT2FN

from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.clip import CLIPVisionModel, feature_layer_index
from pagedllm.model_executor.models.llama import LlamaForCausalLM, load_llama_weights
from pagedllm.model_executor.utils import renamed_by_prefix

#: Checkpoint name prefixes -> ours (the first that matches renames).
_RENAMED_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
)
_SELECT_STRATEGIES = ("default", "full")


def vision_config_as(config: PretrainedConfig, config_class: type, model_name: str) -> Any:
    """The vision tower's config carried on ``config`` (a config or its dict), as
    ``config_class`` (transformers' vision config class, whose ``model_type`` the tower must
    have); ``model_name`` names the model in the error.

    Raises:
        ValueError: a vision tower of another ``model_type``.
    """
    built = config_class.model_type
    vision = config.vision_config
    if isinstance(vision, dict):
        vision = config_class(**{k: v for k, v in vision.items() if k != "model_type"})
    if getattr(vision, "model_type", built) != built:
        raise ValueError(f"{model_name} with a {vision.model_type!r} vision tower is not built (built: {built}).")
    return vision


def vision_config_of(config: PretrainedConfig) -> CLIPVisionConfig:
    """Llava's CLIP vision config (``vision_config_as``).

    Raises:
        ValueError: a vision tower other than CLIP's.
    """
    return vision_config_as(config, CLIPVisionConfig, "Llava")


class LlavaMultiModalProjector(nn.Module):
    """linear_2(act(linear_1(features))): [.., vision width x feature layers] -> [.., hidden]."""

    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(in_features, hidden, bias=bias, prefix="multi_modal_projector.linear_1")
        self.act = ACT2FN[act]
        self.linear_2 = RowParallelLinear(hidden, hidden, bias=bias, prefix="multi_modal_projector.linear_2")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class ImageTextModel(nn.Module):
    """What Llava, Gemma 3 and Mistral 3 share around their own vision tower and projector:
    the ``language_model`` (a ``LlamaForCausalLM``-like module) embeds, runs and scores the
    tokens, and ``load_weights`` maps the checkpoint by the subclass's ``renamed_prefixes``
    (``load_image_text_weights``)."""

    #: Checkpoint name prefixes -> ours (``renamed_by_prefix``: the first that matches renames).
    renamed_prefixes: tuple[tuple[str, str], ...] = ()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the language model's token embeddings [T, hidden]."""
        return self.language_model.model.embed_input_ids(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        intermediate_tensors: Optional[dict[str, torch.Tensor]] = None, inputs_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """As ``LlamaForCausalLM.forward``; ``inputs_embeds`` [T, hidden] (``embed_input_ids``
        with the images' embeddings merged in) replaces the embedding of ``input_ids`` when given."""
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the checkpoint (either transformers naming, see the model's module docstring);
        returns the parameter names loaded.

        Raises:
            ValueError: a tensor with no matching parameter, or a shape mismatch.
        """
        return load_image_text_weights(self, weights, self.renamed_prefixes)


class LlavaForConditionalGeneration(ImageTextModel):
    """Images and text in, text out; ``LlamaForCausalLM``'s interface plus the image path.

    Args:
        config: the language model's config with Llava's vision keys (see the module docstring).
        quant_config: the language model's linear layers' method (the vision path is unquantized).

    Raises:
        ValueError: a ``vision_feature_select_strategy`` other than "default" / "full", a
            feature layer outside the tower, a tower other than CLIP's.
    """

    renamed_prefixes = _RENAMED_PREFIXES

    #: The inputs ``get_multimodal_embeddings`` takes, per image (``pagedllm.multimodal.processing``).
    mm_input_names = ("pixel_values",)

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        self.config = config
        vision = vision_config_of(config)
        strategy = config.vision_feature_select_strategy
        if strategy not in _SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not built (built: {_SELECT_STRATEGIES}).")
        self.drop_class_token = strategy == "default"
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.vision_tower = CLIPVisionModel(vision, [feature_layer_index(k, vision.num_hidden_layers) for k in layers])
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size * len(layers), config.hidden_size, config.projector_hidden_act,
            bool(getattr(config, "multimodal_projector_bias", True)),
        )
        self.language_model = LlamaForCausalLM(config, quant_config)
        num_patches = (vision.image_size // vision.patch_size) ** 2
        #: Embeddings (placeholder tokens) of one image.
        self.num_image_tokens = num_patches + (0 if self.drop_class_token else 1)

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H, W] -> the images' embeddings [N, num_image_tokens, hidden] (model dtype)."""
        states = self.vision_tower(pixel_values.to(self.multi_modal_projector.linear_1.weight.dtype))
        features = torch.cat(states, dim=-1)
        if self.drop_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)


def load_image_text_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                            prefixes: Sequence[tuple[str, str]]) -> set[str]:
    """Load a vision-tower + projector + language-model checkpoint into ``model`` (Llava,
    Gemma 3, Mistral 3): each name's checkpoint prefix is replaced by this model's
    (``renamed_by_prefix`` with ``prefixes``, the first match), then ``language_model.*``
    goes to ``model.language_model.load_weights``, ``vision_tower.*`` to
    ``model.vision_tower.load_weights`` and the rest (the projector) to ``model``'s own
    parameters; returns the parameter names loaded.

    Raises:
        ValueError: a tensor with no matching parameter, or a shape mismatch.
    """
    parts: dict[str, list[tuple[str, torch.Tensor]]] = {"language_model": [], "vision_tower": [], "": []}
    for name, tensor in weights:
        name = renamed_by_prefix(name, prefixes)
        head = name.split(".", 1)[0]
        if head in ("language_model", "vision_tower"):
            parts[head].append((name[len(head) + 1:], tensor))
        else:
            parts[""].append((name, tensor))
    loaded = {f"language_model.{n}" for n in model.language_model.load_weights(parts["language_model"])}
    loaded |= {f"vision_tower.{n}" for n in model.vision_tower.load_weights(parts["vision_tower"])}
    return loaded | load_llama_weights(model, parts[""])
