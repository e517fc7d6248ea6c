"""The dummy image of the start-up memory profile (vLLM's dummy multimodal inputs): the
largest image an image-text model's limits allow, through the checkpoint's own processor, so
that the KV-cache sizing leaves room for the vision encoder's activations on it.

The largest image is a square of side: Qwen-VL, sqrt(``max_pixels``) (``max_pixels_of``: the
configured ``--mm-processor-kwargs`` or the checkpoint's preprocessor_config.json); Mistral 3,
the processor's ``longest_edge`` (else the vision tower's ``image_size``); Llava and Gemma 3,
the vision tower's ``image_size`` (their processors resize every image to it). A request's own
``mm_processor_kwargs`` (``--trust-request-mm-kwargs``) are not foreseen, as in vLLM.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch

from pagedllm.multimodal.budget import GRID_ARCHITECTURES, vision_value, longest_edge_of, max_pixels_of
from pagedllm.multimodal.processing import MULTIMODAL_LAYOUTS, MultiModalProcessor


def largest_image_side(hf_config: Any, model_dir: Optional[Path], mm_processor_kwargs: Optional[dict]
                       ) -> Optional[int]:
    """The side (pixels) of the square dummy image (see the module docstring); None for a
    text-only model, or a Qwen-VL checkpoint whose processor sets no ``max_pixels``."""
    architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
    if architecture not in MULTIMODAL_LAYOUTS:
        return None
    if architecture in GRID_ARCHITECTURES:
        max_pixels = max_pixels_of(model_dir, mm_processor_kwargs)
        return None if max_pixels is None else math.isqrt(max_pixels)
    vision = hf_config.vision_config
    if architecture == "Mistral3ForConditionalGeneration":
        return longest_edge_of(model_dir, mm_processor_kwargs) or vision_value(vision, "image_size")
    return int(vision_value(vision, "image_size"))


def dummy_image_inputs(model_config: Any) -> Optional[dict[str, torch.Tensor]]:
    """The encoder inputs (``get_multimodal_embeddings``' keyword arguments, CPU tensors) of
    the largest image of ``model_config``'s model (a black square of ``largest_image_side``),
    made by its processor under ``--mm-processor-kwargs``; None where there is none.

    Raises:
        ValueError: the processor refuses the image (see ``MultiModalProcessor.apply``).
    """
    hf_config = model_config.hf_config
    mm_kwargs = model_config.multimodal_config.mm_processor_kwargs
    side = largest_image_side(hf_config, model_config.model_dir, mm_kwargs)
    if side is None:
        return None
    from PIL import Image

    processor = MultiModalProcessor(model_config.model_path, model_config.architecture, hf_config,
                                    model_config.trust_remote_code, mm_kwargs)
    _, (feature,) = processor.apply(processor.placeholder_text(), [Image.new("RGB", (side, side))])
    return {name: data.to_tensor() for name, data in feature.data.items()}
