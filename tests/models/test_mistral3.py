"""Mistral 3 with images (``Mistral3ForConditionalGeneration``: Pixtral tower, patch merger) on a
tiny checkpoint with its processor's files, in one engine with 24-token steps (a prompt's image
runs are cut across chunks, mid-row too) and prefix caching: greedy output token-identical to
transformers float32 with one image, two images of different sizes (6 x 5 and 3 x 6 tokens:
different [IMG_BREAK] patterns) and a text-only prompt; the two-image prompt's logprobs close to
transformers'; the same image again hits the prefix cache, another image with the same text
hits nothing; a prompt with fewer [IMG] than images is refused; then the block and
encoder-cache accounting checks. Too few blocks for three two-image prompts: they are preempted
and recomputed to the same tokens. One chat request with a ``data:`` URL image through a real
``pagedllm serve`` gives transformers' reply."""

from __future__ import annotations

import base64
import io

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import check_block_accounting
from tests.multimodal.checkpoints import (
    hf_mistral3_greedy,
    hf_mistral3_log_softmax,
    mistral3_checkpoint,
    random_image,
)
from tests.multimodal.scenarios import MAX_TOKENS, check_caches_released, check_image_prompts, image_prompt
from tests.server_utils import RemoteServer

ONE_IMAGE = "Describe [IMG]"
TWO_IMAGES = "Compare [IMG] and [IMG]"


def test_mistral3_images_match_transformers(tmp_path_factory):
    tall, wide, other = random_image(40, 50, seed=1), random_image(64, 30, seed=2), random_image(40, 50, seed=3)
    llm, params = check_image_prompts(mistral3_checkpoint(tmp_path_factory), hf_mistral3_greedy,
                                      hf_mistral3_log_softmax, ONE_IMAGE, TWO_IMAGES, (tall, wide, other),
                                      min_cached=32)
    with pytest.raises(ValueError, match=r"1 \[IMG\] placeholders for 2 image"):
        llm.generate([image_prompt(ONE_IMAGE, [tall, wide])], params, use_tqdm=False)
    check_caches_released(llm)


def test_a_chat_image_url_gives_transformers_reply(tmp_path_factory):
    from transformers import AutoTokenizer

    path = mistral3_checkpoint(tmp_path_factory)
    buffer = io.BytesIO()
    random_image(64, 30, seed=2).save(buffer, format="PNG")
    rendered = "<|im_start|>user\n[IMG]\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
    decoded = random_image(64, 30, seed=2)  # PNG is lossless: the same pixels
    expected = AutoTokenizer.from_pretrained(path).decode(hf_mistral3_greedy(path, rendered, [decoded], MAX_TOKENS))
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    remote = RemoteServer(path, "--served-model-name", "mistral3", "--dtype", "float32")
    try:
        response = remote.client().chat.completions.create(
            model="mistral3", messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True})
    finally:
        remote.close()
    assert response.choices[0].message.content == expected


#: Bytes of one KV block of the tiny model at block size 8 (2 layers, K and V, 2 heads of 16, float32).
BLOCK_BYTES = 2 * 2 * 8 * 2 * 16 * 4


def test_preemption_recomputes_with_images(tmp_path_factory):
    path = mistral3_checkpoint(tmp_path_factory)
    images = [random_image(40, 50, seed=1), random_image(64, 30, seed=2), random_image(30, 30, seed=4)]
    # Each prompt is about 60 tokens with 12 outputs (9 to 10 blocks): two outgrow 16 blocks while decoding.
    prompts = [image_prompt(TWO_IMAGES, [images[i], images[(i + 1) % 3]]) for i in range(3)]
    expected = [hf_mistral3_greedy(path, TWO_IMAGES, p["multi_modal_data"]["image"], 12) for p in prompts]
    llm = LLM(str(path), dtype="float32", block_size=8, max_model_len=96, enable_prefix_caching=False,
              kv_cache_memory_bytes=16 * BLOCK_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "the scenario did not preempt"
    check_block_accounting(llm)
