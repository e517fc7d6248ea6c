"""The image-prompt scenario every vision-language model's test runs, on one engine.

``check_image_prompts``: 24-token steps and prefix caching; greedy output token-identical to
transformers float32 for one image, two images of different sizes and a text-only prompt; the
two-image prompt's logprobs within 1e-3 of transformers'; the same image again hits the prefix
cache, another image with the same text hits nothing. The caller adds its model's own checks,
then ``check_caches_released``.

``check_lora_image_prompts``: a LoRA adapter on the language model (``make_vl_adapter``, PEFT)
with image prompts, greedy output token-identical to transformers + PEFT merged.
"""

from __future__ import annotations

from typing import Callable

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest
from tests.helpers import check_block_accounting, randomize_lora

MAX_TOKENS = 5
TEXT_ONLY = "A text-only prompt about nothing in particular."

#: ``(path, prompt, images, max_new_tokens) -> token ids``: transformers' greedy completion.
HfGreedy = Callable[..., list[int]]
#: ``(path, prompt, images, continuation) -> (log-softmax [tokens, vocab], prompt length)``.
HfLogSoftmax = Callable[..., tuple[torch.Tensor, int]]
#: ``path -> token ids per prompt``: transformers' greedy completions of a scenario's prompts.
HfExpected = Callable[..., list[list[int]]]


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


#: PEFT's target of the language model's attention projections in every image-text checkpoint here
#: (transformers' module names: ``model.language_model.layers.N.self_attn.q_proj``).
LANGUAGE_MODEL_TARGETS = r".*language_model.*\.(q_proj|v_proj)"


def make_vl_adapter(base, out, target_modules=LANGUAGE_MODEL_TARGETS, seed: int = 5):
    """A PEFT LoRA adapter (r 4, A and B drawn at random) on the image-text checkpoint ``base``
    (its ``architectures`` class of transformers) for the modules ``target_modules`` (PEFT's: a
    regex, or names) picks, and its merged checkpoint beside the base's processor and tokenizer
    files; returns (adapter folder, merged folder)."""
    import shutil

    import transformers
    from peft import LoraConfig, get_peft_model

    model_class = getattr(transformers, transformers.AutoConfig.from_pretrained(base).architectures[0])
    model = model_class.from_pretrained(base, dtype=torch.float32)
    peft_model = randomize_lora(get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules,
                                                                 lora_dropout=0.0, bias="none")), seed)
    adapter, merged = out / "adapter", out / "merged"
    peft_model.save_pretrained(adapter)
    peft_model.merge_and_unload().save_pretrained(merged)
    for source in base.iterdir():  # the processor's and tokenizer's files
        if not (merged / source.name).exists():
            shutil.copy(source, merged / source.name)
    return adapter, merged


def check_lora_image_prompts(base, adapter, merged, prompts: list[tuple[str, int]], images: list,
                             expected: HfExpected, max_tokens: int, **engine_kwargs) -> LLM:
    """An adapter on the language model with image prompts: ``prompts`` ((text, k): the text
    with ``images[:k]``) under the adapter and without it, ``max_tokens`` each, in one batch with 16-token steps and
    prefix caching (the same images, different blocks), greedy output token-identical to
    transformers' on ``merged`` and on ``base`` (``expected(path) -> token ids per prompt``).
    Returns the engine, for the caller's further checks, then ``check_caches_released``."""
    expected_base, expected_lora = expected(base), expected(merged)
    assert expected_base != expected_lora, "the adapter does not change the output: the test would not see a bug"
    llm = LLM(str(base), dtype="float32", kv_cache_memory_bytes=16 << 20, enable_lora=True, max_loras=1,
              max_lora_rank=8, max_num_batched_tokens=16, enable_prefix_caching=True, **engine_kwargs)
    lora = LoRARequest("lang", 1, str(adapter))
    requests = [{"prompt": p, "multi_modal_data": {"image": images[:k]}} for p, k in prompts] * 2
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(requests, params, lora_request=[lora] * len(prompts) + [None] * len(prompts),
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected_lora + expected_base
    return llm
