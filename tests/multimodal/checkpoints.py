"""Tiny image-text checkpoints written by transformers, each with its processor saved beside
it, weights drawn as ``tests.fixtures.checkpoints``':

- Llava: a CLIP vision tower (32 x 32 pixels in 8 x 8 patches: 16 image tokens, 3 layers,
  features from the second to last), the projector and a Llama language model (hidden 64, 2
  layers) over the tests' tokenizer plus an ``<image>`` token, and a ``LlavaProcessor``
  (``CLIPImageProcessor``: images of any size are resized and cropped to 32 x 32); the
  projector's output scaled up, so images change the greedy output.
- Gemma 3: a SigLIP vision tower (32 x 32 pixels in 4 x 4 patches, 2 layers) pooled to 16 image
  tokens, and a Gemma 3 language model (hidden 64, a sliding layer with an 8-token window and
  a full one) over the tests' tokenizer plus ``<start_of_image>``, ``<end_of_image>`` and
  ``<image_soft_token>``, and a ``Gemma3Processor`` (images resized to 32 x 32; a prompt's
  ``<start_of_image>`` becomes the image's 16 soft tokens between the two markers); the text
  embeddings scaled down to the images' size, so images change the greedy output.
- Mistral 3: a Pixtral vision tower (4 x 4 patches, 2 layers, 2-D rope) merged 2 x 2, so one
  embedding per 8 x 8 pixels, and a Mistral language model (hidden 64, 2 layers) over the tests'
  tokenizer plus ``[IMG]``, ``[IMG_BREAK]`` and ``[IMG_END]``, the Pillow ``PixtralImageProcessor``
  (longest side 48 pixels, sides rounded up to 8) and the processor_config.json of transformers'
  ``PixtralProcessor`` (which needs torchvision, absent here: ``hf_mistral3_inputs`` applies its
  rule); the projector's output scaled up, so images change the greedy output.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

#: Image tokens per image (16 patches; the "default" strategy drops the class token).
NUM_IMAGE_TOKENS = 16


def make_llava_checkpoint(out: Path, seed: int = 21, vision_feature_select_strategy: str = "default",
                          pad_vocab_to: int = 1) -> Path:
    """Write the checkpoint, tokenizer and processor to ``out``; returns ``out``. The
    vocabulary is padded to a multiple of ``pad_vocab_to`` (as real Llava checkpoints are)."""
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
                       intermediate_size=128, vocab_size=-(-len(tokenizer) // pad_vocab_to) * pad_vocab_to,
                       max_position_embeddings=2048, bos_token_id=0, eos_token_id=0, pad_token_id=0)
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


def make_gemma3_checkpoint(out: Path, seed: int = 31) -> Path:
    """Write the Gemma 3 checkpoint, tokenizer and processor to ``out``; returns ``out``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor
    from transformers import Gemma3TextConfig, SiglipVisionConfig
    from transformers.initialization import no_init_weights

    from tests.fixtures.checkpoints import _init_weights, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = copy.deepcopy(build_tokenizer())
    markers = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *markers.values()]})
    tokenizer._set_model_specific_special_tokens(special_tokens=markers)  # saved as its extra_special_tokens
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=4, vision_use_head=False)
    text = Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=2048, query_pre_attn_scalar=24,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in markers.items()}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=NUM_IMAGE_TOKENS,
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                          image_token_index=ids["image_token"], tie_word_embeddings=False)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    with no_init_weights():
        model = Gemma3ForConditionalGeneration(config)
    _init_weights(model, seed)
    with torch.no_grad():  # text embeddings (times sqrt(hidden) in the model) down to the images' size
        model.model.language_model.embed_tokens.weight.mul_(0.125)
    model.eval().save_pretrained(out)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=tokenizer, image_seq_length=NUM_IMAGE_TOKENS)
    processor.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=3)
def _hf_model(path: Path):
    import transformers
    from transformers import AutoConfig, AutoProcessor

    model_class = getattr(transformers, AutoConfig.from_pretrained(path).architectures[0])
    return AutoProcessor.from_pretrained(path), model_class.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: str, images: list, max_new_tokens: int, **processor_kwargs) -> list[int]:
    """transformers' float32 greedy completion of ``prompt`` with ``images``, through the
    checkpoint's processor (any of the image-text checkpoints here) called with ``processor_kwargs``."""
    processor, model = _hf_model(path)
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt", **processor_kwargs)
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


#: Qwen-VL placeholder tokens added to the tests' tokenizer (the processors' and chat template's).
QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


#: The factor on the Qwen-VL mergers' output weights.
MERGER_SCALE = 30.0


def make_qwen_vl_checkpoint(out: Path, architecture: str = "Qwen2_5_VLForConditionalGeneration", seed: int = 21,
                            *, vision_config: Optional[dict] = None, text_config: Optional[dict] = None,
                            image_processor: Optional[dict] = None, tie_word_embeddings: bool = False,
                            tokenizer_vocab_size: int = 1024, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny Qwen2.5-VL (or Qwen3-VL) checkpoint written by transformers: a vision tower of 8 x 8
    patches merged 2 x 2 (Qwen2.5-VL: 3 blocks, windows of 2 x 2 merged patches, block 1 full;
    Qwen3-VL: 3 blocks, deepstack features after blocks 0 and 1), a language model of hidden 64
    and 2 layers with multimodal RoPE over the tests' tokenizer plus the Qwen-VL tokens, and the
    image processor (images resized to multiples of 16 pixels, 16^2 .. 96^2 pixels). Weights as
    ``tests.fixtures.checkpoints``'; the merger's output scaled up, so images change the output.

    ``vision_config``, ``text_config`` and ``image_processor`` update the vision config, the text
    config and the ``Qwen2VLImageProcessor`` options (for Qwen2.5-VL, ``vision_config`` may replace
    the window and the full-attention blocks too); the tokenizer has ``tokenizer_vocab_size``
    tokens before the Qwen-VL ones; weights are saved in ``dtype`` (drawn in float32)."""
    from transformers import Qwen2VLImageProcessor
    from transformers.initialization import no_init_weights

    from tests.fixtures.checkpoints import _init_weights, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = copy.deepcopy(build_tokenizer(tokenizer_vocab_size))
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VL_TOKENS)})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64)
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=2048,
                bos_token_id=0, eos_token_id=0, pad_token_id=0)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model

        vision.update(window_size=32, fullatt_block_indexes=[1])
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        merger_outs = ("model.visual.merger.mlp.2.weight",)
    else:
        from transformers import Qwen3VLConfig as Config, Qwen3VLForConditionalGeneration as Model

        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh")
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [2, 3, 3], "mrope_interleaved": True})
        merger_outs = ("model.visual.merger.linear_fc2.weight", "model.visual.deepstack_merger_list.0.linear_fc2.weight",
                       "model.visual.deepstack_merger_list.1.linear_fc2.weight")
    vision.update(vision_config or {})
    text.update(text_config or {})
    config = Config(vision_config=vision, text_config=text, tie_word_embeddings=tie_word_embeddings, **tokens)
    config.architectures = [architecture]
    with no_init_weights():
        model = Model(config)
    model.tie_weights()  # NOTE: no_init_weights skips the tying too
    _init_weights(model, seed)
    with torch.no_grad():
        for name in merger_outs:
            dict(model.named_parameters())[name].mul_(MERGER_SCALE)
    model.eval().to(dtype).save_pretrained(out)
    options = dict(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=96 * 96)
    Qwen2VLImageProcessor(**{**options, **(image_processor or {})}).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def hf_qwen_vl_processor(path: Path):
    """transformers' own Qwen-VL processor of the checkpoint for images, built without its video
    processor (which needs torchvision, absent here)."""
    from unittest import mock

    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    cls = Qwen3VLProcessor if AutoConfig.from_pretrained(path).model_type == "qwen3_vl" else Qwen2_5_VLProcessor
    image_processor, tokenizer = AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


@functools.lru_cache(maxsize=2)
def _hf_qwen_vl(path: Path):
    from transformers import AutoModelForImageTextToText

    return hf_qwen_vl_processor(path), AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def hf_qwen_vl_greedy(path: Path, prompt: str, images: list, max_new_tokens: int, **processor_kwargs) -> list[int]:
    """transformers' float32 greedy completion of ``prompt`` (one ``<|image_pad|>`` per image)
    with ``images``, through transformers' processor."""
    processor, model = _hf_qwen_vl(path)
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt", **processor_kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
def gemma3_checkpoint(tmp_path_factory) -> Path:
    """``make_gemma3_checkpoint`` once per test session, under pytest's tmp."""
    if "gemma3" not in _CHECKPOINTS:
        _CHECKPOINTS["gemma3"] = make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3-vl"))
    return _CHECKPOINTS["gemma3"]


def hf_log_softmax(path: Path, prompt: str, images: list, continuation: list[int],
                   **processor_kwargs) -> tuple[torch.Tensor, int]:
    """transformers' float32 log-softmax [prompt + continuation, vocab] of ``prompt`` with
    ``images`` (through the checkpoint's processor called with ``processor_kwargs``, its
    ``token_type_ids`` too) followed by ``continuation``, and the prompt's length in tokens."""
    processor, model = _hf_model(path)
    inputs = dict(processor(text=[prompt], images=images or None, return_tensors="pt", **processor_kwargs))
    num_prompt = inputs["input_ids"].shape[1]
    tail = torch.tensor([continuation])
    inputs["input_ids"] = torch.cat([inputs["input_ids"], tail], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "token_type_ids" in inputs:  # the generated tokens are text
        inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.zeros_like(tail)], dim=1)
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    return torch.log_softmax(logits.float(), dim=-1), num_prompt


#: Mistral 3's image tokens (transformers' ``PixtralProcessor`` defaults) and its processor options.
PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
PIXTRAL_PATCH, PIXTRAL_MERGE, PIXTRAL_LONGEST_EDGE = 4, 2, 48


def make_mistral3_checkpoint(out: Path, seed: int = 41) -> Path:
    """Write the Mistral 3 checkpoint, tokenizer, image processor and processor_config.json to
    ``out``; returns ``out``."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig
    from transformers import PixtralImageProcessorPil, PixtralVisionConfig
    from transformers.initialization import no_init_weights

    from tests.fixtures.checkpoints import _init_weights, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *PIXTRAL_TOKENS]})
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=PIXTRAL_LONGEST_EDGE, patch_size=PIXTRAL_PATCH)
    text = MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=2048,
                         sliding_window=None, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config = Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=PIXTRAL_MERGE,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)
    config.architectures = ["Mistral3ForConditionalGeneration"]
    with no_init_weights():
        model = Mistral3ForConditionalGeneration(config)
    _init_weights(model, seed)
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)
    model.eval().save_pretrained(out)
    side = PIXTRAL_PATCH * PIXTRAL_MERGE
    PixtralImageProcessorPil(size={"longest_edge": PIXTRAL_LONGEST_EDGE},
                             patch_size={"height": side, "width": side}).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": PIXTRAL_PATCH, "spatial_merge_size": PIXTRAL_MERGE,
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}))
    return out


def mistral3_checkpoint(tmp_path_factory) -> Path:
    """``make_mistral3_checkpoint`` once per test session, under pytest's tmp."""
    if "mistral3" not in _CHECKPOINTS:
        _CHECKPOINTS["mistral3"] = make_mistral3_checkpoint(tmp_path_factory.mktemp("mistral3"))
    return _CHECKPOINTS["mistral3"]


def hf_mistral3_inputs(path: Path, prompt: str, images: list) -> dict:
    """transformers' Mistral 3 inputs of ``prompt`` (one ``[IMG]`` per image) with ``images``:
    the checkpoint's image processor, then ``PixtralProcessor``'s expansion of each ``[IMG]`` to
    rows of ``[IMG]`` x columns + ``[IMG_BREAK]``, the last break ``[IMG_END]``, tokenized."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    side = PIXTRAL_PATCH * PIXTRAL_MERGE
    inputs = dict(AutoImageProcessor.from_pretrained(path)(images, patch_size=side, return_tensors="pt")) if images else {}
    pieces = prompt.split("[IMG]")
    assert len(pieces) - 1 == len(images)
    text = pieces[0]
    for (height, width), piece in zip(inputs.get("image_sizes", torch.empty(0, 2)).tolist(), pieces[1:]):
        rows = [["[IMG]"] * (width // side) + ["[IMG_BREAK]"] for _ in range(height // side)]
        tokens = [t for row in rows for t in row]
        tokens[-1] = "[IMG_END]"
        text += "".join(tokens) + piece
    inputs["input_ids"] = torch.tensor([tokenizer(text)["input_ids"]])
    return inputs


@functools.lru_cache(maxsize=1)
def _hf_mistral3(path: Path):
    from transformers import Mistral3ForConditionalGeneration

    return Mistral3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def hf_mistral3_greedy(path: Path, prompt: str, images: list, max_new_tokens: int) -> list[int]:
    """transformers' float32 greedy completion of ``prompt`` with ``images`` (``hf_mistral3_inputs``)."""
    inputs = hf_mistral3_inputs(path, prompt, images)
    with torch.no_grad():
        out = _hf_mistral3(path).generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                          min_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_mistral3_log_softmax(path: Path, prompt: str, images: list, continuation: list[int]) -> tuple[torch.Tensor, int]:
    """transformers' float32 log-softmax [prompt + continuation, vocab] of ``prompt`` with
    ``images`` (``hf_mistral3_inputs``) followed by ``continuation``, and the prompt's length."""
    inputs = hf_mistral3_inputs(path, prompt, images)
    num_prompt = inputs["input_ids"].shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([continuation])], dim=1)
    with torch.no_grad():
        logits = _hf_mistral3(path)(**inputs).logits[0]
    return torch.log_softmax(logits.float(), dim=-1), num_prompt
