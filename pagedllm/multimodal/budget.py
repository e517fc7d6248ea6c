"""The encoder budget of an image-text model (plain Python; no torch), as vLLM's
``compute_encoder_budget``: the embeddings the encoder may compute in one step and the encoder
cache holds, ``max(max_num_batched_tokens, the largest item's embeddings)`` so that any one
image can always run."""

from __future__ import annotations

from typing import Any, Optional

from pagedllm.arch_config import IMAGE_TEXT_ARCHITECTURES


def _vision_value(vision: Any, key: str) -> Any:
    return vision[key] if isinstance(vision, dict) else getattr(vision, key)


def max_tokens_per_mm_item(hf_config: Any) -> Optional[int]:
    """The most placeholder tokens one image fills in ``hf_config``'s model (Llava: one per
    patch, plus the class token under ``vision_feature_select_strategy`` "full"; Gemma 3:
    ``mm_tokens_per_image``); None for a text-only model."""
    architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
    if architecture not in IMAGE_TEXT_ARCHITECTURES:
        return None
    if architecture == "Gemma3ForConditionalGeneration":
        return int(hf_config.mm_tokens_per_image)
    vision = hf_config.vision_config
    num_patches = (_vision_value(vision, "image_size") // _vision_value(vision, "patch_size")) ** 2
    return num_patches + (hf_config.vision_feature_select_strategy == "full")


def encoder_cache_size(hf_config: Any, max_num_batched_tokens: int) -> Optional[int]:
    """The encoder budget in embeddings (see the module docstring); None for a text-only model."""
    per_item = max_tokens_per_mm_item(hf_config)
    return None if per_item is None else max(max_num_batched_tokens, per_item)
