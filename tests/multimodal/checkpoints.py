"""A tiny Llava checkpoint written by transformers: a CLIP vision tower (32 x 32 pixels in
8 x 8 patches: 16 image tokens, 3 layers, features from the second to last), the projector and
a Llama language model (hidden 64, 2 layers) over the tests' tokenizer plus an ``<image>``
token, and a ``LlavaProcessor`` (``CLIPImageProcessor``: images of any size are resized and
cropped to 32 x 32) saved beside it. Weights drawn as ``tests.fixtures.checkpoints``' (the
projector's output scaled up, so images change the greedy output)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
import torch

#: Image tokens per image (16 patches; the "default" strategy drops the class token).
NUM_IMAGE_TOKENS = 16


def make_llava_checkpoint(out: Path, seed: int = 21, vision_feature_select_strategy: str = "default") -> Path:
    """Write the checkpoint, tokenizer and processor to ``out``; returns ``out``."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration, LlavaProcessor
    from transformers.initialization import no_init_weights

    from tests.fixtures.checkpoints import _init_weights, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=2048,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                         vision_feature_select_strategy=vision_feature_select_strategy,
                         image_seq_length=NUM_IMAGE_TOKENS)
    config.architectures = ["LlavaForConditionalGeneration"]
    with no_init_weights():
        model = LlavaForConditionalGeneration(config)
    _init_weights(model, seed)
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)
    model.eval().save_pretrained(out)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy=vision_feature_select_strategy,
                               num_additional_image_tokens=1)
    processor.save_pretrained(out)
    return out


def random_image(width: int, height: int, seed: int):
    """An RGB PIL image of random pixels."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@functools.lru_cache(maxsize=2)
def _hf_llava(path: Path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return AutoProcessor.from_pretrained(path), LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def hf_llava_greedy(path: Path, prompt: str, images: list, max_new_tokens: int) -> list[int]:
    """transformers' float32 greedy completion of ``prompt`` with ``images``, through the
    checkpoint's processor."""
    processor, model = _hf_llava(path)
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


_CHECKPOINTS: dict[str, Path] = {}


def llava_checkpoint(tmp_path_factory, vision_feature_select_strategy: str = "default") -> Path:
    """``make_llava_checkpoint`` once per test session (and strategy), under pytest's tmp."""
    if vision_feature_select_strategy not in _CHECKPOINTS:
        out = tmp_path_factory.mktemp(f"llava-{vision_feature_select_strategy}")
        _CHECKPOINTS[vision_feature_select_strategy] = make_llava_checkpoint(
            out, vision_feature_select_strategy=vision_feature_select_strategy)
    return _CHECKPOINTS[vision_feature_select_strategy]
