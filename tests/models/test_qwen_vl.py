"""Qwen2.5-VL and Qwen3-VL (``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``)
on tiny checkpoints transformers writes: greedy output token-identical to transformers' float32
``generate`` (through transformers' own processor) with one image, two images of different sizes
in one prompt, a text-only prompt and an image resized by a request's ``max_pixels``, all under
chunked prefill of 8-token steps that cut the images' placeholder runs; the prompt's three-row
positions equal transformers' ``get_rope_index``; with prefix caching the same image and text
hit the cache and another image with the same text does not; a preempted request's positions are
computed again (Qwen2.5-VL); block and encoder-cache accounting checked at the end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.multimodal.processing import MultiModalProcessor
from tests.helpers import check_block_accounting
from tests.multimodal.checkpoints import (
    hf_qwen_vl_greedy,
    hf_qwen_vl_processor,
    make_qwen_vl_checkpoint,
    random_image,
    _hf_qwen_vl,
)

MAX_TOKENS = 5
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE_IMAGE = f"{IMAGE} What is in this picture?"
TWO_IMAGES = f"First {IMAGE} then {IMAGE}: compare them."
TEXT_ONLY = "Describe a sunny day in the park."
#: A request's processor option: images of at most 32 x 32 pixels (4 tokens).
SMALL = {"max_pixels": 32 * 32}
QUESTION = "What is this?"
#: The chat template's rendering of one user message with one image and ``QUESTION``.
RENDERED = f"<|im_start|>user\n{IMAGE}\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
#: A template that loops over a message's parts and writes the vision tokens itself, as
#: Qwen-VL checkpoints' own templates do (vLLM's "openai" content format).
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: ``PARTS_TEMPLATE``'s rendering of that message: the image where its part is, no newline added.
RENDERED_BY_PARTS = f"<|im_start|>user\n{QUESTION} {IMAGE}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def images():
    # 48 x 32 pixels (6 tokens), 32 x 80 (10 tokens), 64 x 64 (16 tokens, 4 in SMALL).
    return [random_image(40, 50, seed=1), random_image(80, 40, seed=2), random_image(64, 64, seed=3)]


def _prompt(text: str, images: list, **extra) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}, **extra} if images else text


def _tokens(llm: LLM, prompts: list) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _check_accounting(llm: LLM) -> None:
    check_block_accounting(llm)
    manager = llm.llm_engine.engine_core.scheduler.encoder_cache_manager
    assert not any(manager.cached.values()), "an encoder-cache entry is still referenced"
    assert manager.num_free_slots + sum(manager.freeable.values()) == manager.cache_size


def _check_positions(path, model, prompt: str, images: list) -> None:
    """The model's prompt positions and decode offset are transformers' ``get_rope_index``'s."""
    processor, hf_model = _hf_qwen_vl(path)
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    expected, delta = hf_model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                    image_grid_thw=inputs["image_grid_thw"])
    ours = MultiModalProcessor(path, model.config.architectures[0], model.config).apply(prompt, images)
    positions, our_delta = model.get_mrope_input_positions(*ours)
    assert np.array_equal(positions, expected[:, 0].numpy()) and our_delta == int(delta)


@pytest.mark.parametrize("architecture", ["Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"])
def test_qwen_vl_greedy_matches_transformers(tmp_path_factory, images, architecture):
    path = make_qwen_vl_checkpoint(tmp_path_factory.mktemp(architecture), architecture)
    cases = [(ONE_IMAGE, [images[0]], {}), (TWO_IMAGES, images[:2], {}), (TWO_IMAGES, images[1::-1], {}),
             (TEXT_ONLY, [], {}), (ONE_IMAGE, [images[2]], SMALL)]
    # transformers' processor spells max_pixels as size's longest_edge.
    hf_kwargs = [{"size": {"shortest_edge": 16 * 16, "longest_edge": k["max_pixels"]}} if k else {} for *_, k in cases]
    expected = [hf_qwen_vl_greedy(path, text, imgs, MAX_TOKENS, **kw) for (text, imgs, _), kw in zip(cases, hf_kwargs)]
    assert expected[1] != expected[2], "the images do not change the output: the test would not see a bug"
    assert hf_qwen_vl_processor(path)(text=[ONE_IMAGE], images=[images[2]], **hf_kwargs[-1])["image_grid_thw"].tolist() \
        == [[1, 4, 4]], "max_pixels did not shrink the image"
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=8, enable_prefix_caching=True,
              trust_request_mm_kwargs=True, kv_cache_memory_bytes=4 << 20)
    model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
    _check_positions(path, model, TWO_IMAGES, images[:2])
    prompts = [_prompt(text, imgs, **({"mm_processor_kwargs": kwargs} if kwargs else {})) for text, imgs, kwargs in cases]
    assert _tokens(llm, prompts) == expected
    # Prefix caching: the same image and text again hit; another image with the same text does not.
    again, = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)
    assert list(again.outputs[0].token_ids) == expected[0] and again.num_cached_tokens >= 8
    other, = llm.generate([_prompt(ONE_IMAGE, [images[1]])], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                             ignore_eos=True), use_tqdm=False)
    assert other.num_cached_tokens == 0, "another image with the same text hit the first image's blocks"
    assert list(other.outputs[0].token_ids) == hf_qwen_vl_greedy(path, ONE_IMAGE, [images[1]], MAX_TOKENS)
    _check_chat(llm, path, images[1])
    _check_accounting(llm)


def _check_chat(llm: LLM, path, image) -> None:
    """A chat image part becomes the model's vision placeholder (transformers' reply to the
    rendered prompt); a file:// video without --allowed-local-media-path, audio data and an
    image larger than the encoder cache are refused, saying why."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    parts = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": QUESTION}]
    reply, = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)
    assert list(reply.outputs[0].token_ids) == hf_qwen_vl_greedy(path, RENDERED, [image], MAX_TOKENS)
    # A template that renders the parts itself gets them, images as {"type": "image"} (vLLM's
    # "openai" content format), so the prompt is the one transformers' apply_chat_template makes.
    parts = [{"type": "text", "text": QUESTION + " "}, {"type": "image_pil", "image_pil": image}]
    reply, = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False, chat_template=PARTS_TEMPLATE)
    assert reply.prompt == RENDERED_BY_PARTS
    assert list(reply.outputs[0].token_ids) == hf_qwen_vl_greedy(path, RENDERED_BY_PARTS, [image], MAX_TOKENS)
    video = [{"type": "video_url", "video_url": {"url": "file:///clip.mp4"}}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: file:// video URLs are refused"):
        llm.chat([{"role": "user", "content": video}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="unknown modality 'audio'"):
        llm.generate({"prompt": ONE_IMAGE, "multi_modal_data": {"audio": [image]}}, params, use_tqdm=False)
    # The encoder cache holds the checkpoint's largest image (96 x 96 pixels: 36 embeddings);
    # a request's larger max_pixels may not make one that never fits.
    big = _prompt(ONE_IMAGE, [random_image(160, 160, seed=4)], mm_processor_kwargs={"max_pixels": 160 * 160})
    with pytest.raises(ValueError, match="An image of 100 tokens is larger than the encoder cache \\(36 embeddings"):
        llm.generate(big, params, use_tqdm=False)


def test_preemption_recomputes_the_prompt_positions(tmp_path_factory, images):
    """Too few blocks for the batch: a preempted request comes back as a new one, its three-row
    prompt positions computed again, and its output is transformers'."""
    path = make_qwen_vl_checkpoint(tmp_path_factory.mktemp("preempt"))
    # Each prompt (32 tokens, 12 outputs: 6 blocks of 8) outgrows the 12 blocks beside another one.
    prompts = [_prompt(TWO_IMAGES, [images[i], images[(i + 1) % 3]]) for i in range(3)]
    expected = [hf_qwen_vl_greedy(path, TWO_IMAGES, p["multi_modal_data"]["image"], 12) for p in prompts]
    # A KV block: 2 layers, K and V, 8 tokens, 2 heads of 16, float32.
    llm = LLM(str(path), dtype="float32", block_size=8, max_model_len=96, enable_prefix_caching=False,
              kv_cache_memory_bytes=12 * (2 * 2 * 8 * 2 * 16 * 4))
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "the scenario did not preempt"
    _check_accounting(llm)
