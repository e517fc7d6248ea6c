"""The image-prompt scenario every vision-language model's test runs, on one engine.

``check_image_prompts``: 24-token steps and prefix caching; greedy output token-identical to
transformers float32 for one image, two images of different sizes and a text-only prompt; the
two-image prompt's logprobs within 1e-3 of transformers'; the same image again hits the prefix
cache, another image with the same text hits nothing. The caller adds its model's own checks,
then ``check_caches_released``.
"""

from __future__ import annotations

from typing import Callable

import torch

from pagedllm import LLM, SamplingParams
from tests.helpers import check_block_accounting

MAX_TOKENS = 5
TEXT_ONLY = "A text-only prompt about nothing in particular."

#: ``(path, prompt, images, max_new_tokens) -> token ids``: transformers' greedy completion.
HfGreedy = Callable[..., list[int]]
#: ``(path, prompt, images, continuation) -> (log-softmax [tokens, vocab], prompt length)``.
HfLogSoftmax = Callable[..., tuple[torch.Tensor, int]]


def image_prompt(text: str, images: list) -> dict | str:
    """``LLM.generate``'s prompt of ``text`` with ``images`` (plain text when there are none)."""
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def check_image_prompts(path, hf_greedy: HfGreedy, hf_log_softmax: HfLogSoftmax, one_image: str,
                        two_images: str, images: tuple, min_cached: int) -> tuple[LLM, SamplingParams]:
    """Run the scenario above on ``path`` with ``images`` = (first, second of another size,
    third of the first's size); ``min_cached``: prompt tokens the repeated image must hit at
    least. Returns the engine and the greedy params, for the caller's further checks."""
    first, second, other = images
    cases = [(one_image, [first]), (two_images, [first, second]), (TEXT_ONLY, [])]
    expected = [hf_greedy(path, text, imgs, MAX_TOKENS) for text, imgs in cases]
    expected_other = hf_greedy(path, one_image, [other], MAX_TOKENS)
    assert expected[0] != expected_other, "the image does not change the output: the test would not see a bug"

    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=24, enable_prefix_caching=True,
              kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([image_prompt(text, imgs) for text, imgs in cases], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    completion = outputs[1].outputs[0]
    reference, num_prompt = hf_log_softmax(path, two_images, [first, second], list(completion.token_ids))
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert abs(entry[token].logprob - reference[num_prompt - 1 + j, token].item()) < 1e-3, f"token {j}"

    again, changed = (llm.generate([image_prompt(one_image, [image])], params, use_tqdm=False)[0]
                      for image in (first, other))
    assert list(again.outputs[0].token_ids) == expected[0]
    assert again.num_cached_tokens >= min_cached, "the same image and text did not hit the prefix cache"
    assert list(changed.outputs[0].token_ids) == expected_other
    assert changed.num_cached_tokens == 0, "another image with the same text hit the first image's blocks"
    return llm, params


def check_caches_released(llm: LLM) -> None:
    """No KV block and no encoder-cache entry is still held."""
    check_block_accounting(llm)
    manager = llm.llm_engine.engine_core.scheduler.encoder_cache_manager
    assert not any(manager.cached.values()), "an encoder-cache entry is still referenced"
