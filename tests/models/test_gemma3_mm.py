"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) on a tiny checkpoint with its own
processor, in one engine with 24-token steps (prompts run in chunks that never cut an image)
and prefix caching: greedy output token-identical to transformers float32 with one image, two
images of different sizes and a text-only prompt; the two-image prompt's logprobs within 1e-3
of transformers' (they move by up to 0.07 when an image's tokens attend causally only, which
greedy tokens of this model do not show); the same image again hits the prefix cache, another
image with the same text hits nothing; then the block and encoder-cache accounting checks.

Pan-and-scan (``do_pan_and_scan``, vLLM's ``mm_processor_kwargs``): a wide image becomes its
thumbnail and three crops, four placeholder runs (each attending to itself both ways); greedy
output equals transformers' with the same options and logprobs are within 1e-3, per request (``trust_request_mm_kwargs``) and server-wide
(``--mm-processor-kwargs`` of ``pagedllm serve``, whose chat reply matches), and the server
without ``--trust-request-mm-kwargs`` answers a request's own ``do_pan_and_scan`` with a 400."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest

from pagedllm import LLM, SamplingParams
from tests.multimodal.checkpoints import NUM_IMAGE_TOKENS, gemma3_checkpoint, hf_greedy, hf_log_softmax, random_image
from tests.multimodal.scenarios import MAX_TOKENS, check_caches_released, check_image_prompts
from tests.server_utils import RemoteServer

#: Pan-and-scan on the tiny checkpoint's 32-pixel images: crops of 16 pixels and more.
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
PROMPT = "Describe <start_of_image> in detail."


def test_gemma3_images_match_transformers(tmp_path_factory):
    images = (random_image(40, 50, seed=1), random_image(64, 30, seed=2), random_image(50, 50, seed=3))
    llm, _ = check_image_prompts(gemma3_checkpoint(tmp_path_factory), hf_greedy, hf_log_softmax,
                                 "Describe <start_of_image>", "Compare <start_of_image> and <start_of_image>",
                                 images, min_cached=NUM_IMAGE_TOKENS)
    check_caches_released(llm)


@pytest.fixture(scope="module")
def wide_image():
    return random_image(100, 40, seed=4)


def _pan_and_scan_prompt(image, kwargs=None) -> dict:
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": [image]}}
    return {**prompt, "mm_processor_kwargs": kwargs} if kwargs else prompt


def test_gemma3_pan_and_scan_matches_transformers(tmp_path_factory, wide_image):
    path = gemma3_checkpoint(tmp_path_factory)
    expected = hf_greedy(path, PROMPT, [wide_image], MAX_TOKENS, **PAN_AND_SCAN)
    assert expected != hf_greedy(path, PROMPT, [wide_image], MAX_TOKENS), "the crops do not change the output"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    per_request = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=24,
                      enable_prefix_caching=True, kv_cache_memory_bytes=4 << 20, trust_request_mm_kwargs=True)
    output = per_request.generate([_pan_and_scan_prompt(wide_image, PAN_AND_SCAN)], params, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == expected
    completion = output.outputs[0]
    reference, num_prompt = hf_log_softmax(path, PROMPT, [wide_image], list(completion.token_ids), **PAN_AND_SCAN)
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert abs(entry[token].logprob - reference[num_prompt - 1 + j, token].item()) < 1e-3, f"token {j}"
    # The thumbnail and three crops: four runs of 16 image tokens, each between its markers.
    assert output.prompt_token_ids.count(per_request.llm_engine.model_config.hf_config.image_token_index) == 64
    check_caches_released(per_request)
    with pytest.raises(ValueError, match="--trust-request-mm-kwargs"):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20).generate(
            [_pan_and_scan_prompt(wide_image, PAN_AND_SCAN)], params, use_tqdm=False)


def _png_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_gemma3_server_wide_pan_and_scan_and_untrusted_request_kwargs(tmp_path_factory, wide_image):
    path = gemma3_checkpoint(tmp_path_factory)
    rendered = "<|im_start|>user\n<start_of_image>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(path).decode(hf_greedy(path, rendered, [wide_image], MAX_TOKENS,
                                                                    **PAN_AND_SCAN))
    server = RemoteServer(path, "--served-model-name", "gemma3", "--mm-processor-kwargs", json.dumps(PAN_AND_SCAN))
    try:
        client = server.client()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(wide_image)}},
                                                 {"type": "text", "text": "What is this?"}]}]

        def reply(**extra) -> str:
            response = client.chat.completions.create(model="gemma3", messages=messages, temperature=0.0,
                                                      max_completion_tokens=MAX_TOKENS,
                                                      extra_body={"ignore_eos": True, **extra})
            return response.choices[0].message.content

        with pytest.raises(openai.BadRequestError, match="--trust-request-mm-kwargs") as info:
            reply(mm_processor_kwargs={"do_pan_and_scan": False})
        assert info.value.status_code == 400
        assert reply() == expected
    finally:
        server.close()
