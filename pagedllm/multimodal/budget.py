"""The encoder budget of an image-text model (plain Python; no torch), as vLLM's
``compute_encoder_budget``: the embeddings the encoder may compute in one step and the encoder
cache holds, ``max(max_num_batched_tokens, the largest item's embeddings)`` so that any one
image can always run. The largest item is the model's fixed count (Llava), or for a model whose
images fill as many tokens as their size asks (Qwen-VL) the count of the largest image its
processor makes: ``max_pixels`` (``--mm-processor-kwargs``' or the checkpoint's
preprocessor_config.json ``size.longest_edge``) over the pixels of one token. Mistral 3's
(Pixtral) images are at most ``size.longest_edge`` pixels a side (the same two sources, else the
vision tower's ``image_size``): (longest_edge / (patch_size x spatial_merge_size))^2 embeddings
(its [IMG_BREAK] / [IMG_END] tokens take none)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from pagedllm.arch_config import IMAGE_TEXT_ARCHITECTURES

#: Architectures whose images fill ``grid_thw.prod() / merge_size^2`` tokens.
GRID_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")


def vision_value(vision: Any, key: str) -> Any:
    """``vision[key]`` of a vision config or its dict."""
    return vision[key] if isinstance(vision, dict) else getattr(vision, key)


def max_pixels_of(model_dir: Optional[Path], mm_processor_kwargs: Optional[dict]) -> Optional[int]:
    """The largest image (pixels) a Qwen-VL processor makes under ``mm_processor_kwargs``
    (``max_pixels``, or ``size["longest_edge"]``) or the checkpoint's preprocessor_config.json
    (``max_pixels``, or ``size.longest_edge``); None when neither says."""
    kwargs = mm_processor_kwargs or {}
    if kwargs.get("max_pixels") is not None:
        return int(kwargs["max_pixels"])
    if isinstance(kwargs.get("size"), dict) and kwargs["size"].get("longest_edge") is not None:
        return int(kwargs["size"]["longest_edge"])
    path = Path(model_dir) / "preprocessor_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return None
    config = json.loads(path.read_text())
    value = config.get("max_pixels") or (config.get("size") or {}).get("longest_edge")
    return None if value is None else int(value)


def longest_edge_of(model_dir: Optional[Path], mm_processor_kwargs: Optional[dict]) -> Optional[int]:
    """The longest side (pixels) a Pixtral processor makes: ``size["longest_edge"]`` of
    ``mm_processor_kwargs`` or of the checkpoint's preprocessor_config.json; None when neither says."""
    size = (mm_processor_kwargs or {}).get("size")
    if isinstance(size, dict) and size.get("longest_edge") is not None:
        return int(size["longest_edge"])
    path = Path(model_dir) / "preprocessor_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return None
    value = (json.loads(path.read_text()).get("size") or {}).get("longest_edge")
    return None if value is None else int(value)


def max_tokens_per_mm_item(hf_config: Any, model_dir: Optional[Path] = None,
                           mm_processor_kwargs: Optional[dict] = None) -> Optional[int]:
    """The most embeddings one image has in ``hf_config``'s model (Llava: one per patch, plus
    the class token under ``vision_feature_select_strategy`` "full"; Gemma 3:
    ``mm_tokens_per_image``; Qwen-VL: those of its processor's largest image,
    ``max_pixels_of``, 0 when unknown; Mistral 3: see the module docstring); None for a
    text-only model."""
    architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
    if architecture not in IMAGE_TEXT_ARCHITECTURES:
        return None
    if architecture == "Gemma3ForConditionalGeneration":
        return int(hf_config.mm_tokens_per_image)
    vision = hf_config.vision_config
    if architecture == "Mistral3ForConditionalGeneration":
        edge = longest_edge_of(model_dir, mm_processor_kwargs) or vision_value(vision, "image_size")
        return (edge // (vision_value(vision, "patch_size") * hf_config.spatial_merge_size)) ** 2
    if architecture in GRID_ARCHITECTURES:
        max_pixels = max_pixels_of(model_dir, mm_processor_kwargs)
        token_side = vision_value(vision, "patch_size") * vision_value(vision, "spatial_merge_size")
        return 0 if max_pixels is None else max_pixels // token_side**2
    num_patches = (vision_value(vision, "image_size") // vision_value(vision, "patch_size")) ** 2
    return num_patches + (hf_config.vision_feature_select_strategy == "full")


def encoder_cache_size(hf_config: Any, max_num_batched_tokens: int, model_dir: Optional[Path] = None,
                       mm_processor_kwargs: Optional[dict] = None) -> Optional[int]:
    """The encoder budget in embeddings (see the module docstring); None for a text-only model."""
    per_item = max_tokens_per_mm_item(hf_config, model_dir, mm_processor_kwargs)
    return None if per_item is None else max(max_num_batched_tokens, per_item)
