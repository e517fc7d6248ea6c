"""Multi-LoRA greedy outputs equal transformers' on the PEFT-merged model
(``merge_and_unload``), with 4 adapters (ranks 2-16, different target modules, rsLoRA, a
``.bin`` one) and base requests mixed in one batch, under chunked prefill, preemption,
fewer slots than adapters, and prefix caching (float32 tiny Llama)."""

from __future__ import annotations

import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest
from tests.helpers import check_block_accounting, float32_llm, hf_greedy, random_prompts
from tests.lora.conftest import ADAPTERS

MAX_TOKENS = 8
PROMPT_LENGTHS = [3, 17, 40, 70]
SCENARIOS = {
    "four_slots": {"max_loras": 4},
    "chunked_prefill_16": {"max_loras": 4, "max_num_batched_tokens": 16},
    # Two slots for four adapters: requests wait for a slot, slots are reused (LRU).
    "two_slots": {"max_loras": 2, "max_cpu_loras": 2},
    # 16 blocks of 8 tokens hold one max_model_len sequence; the batch needs far more.
    "preemption": {"max_loras": 4, "max_model_len": 128, "block_size": 8, "kv_blocks": 16},
}

_references: dict = {}


def _reference(path, prompt):
    key = (str(path), tuple(prompt))
    if key not in _references:
        _references[key] = hf_greedy(path, prompt, MAX_TOKENS)
    return _references[key]


def _mixed_batch(tiny_llama, peft_adapters, prompts):
    """Every prompt once for the base model and once per adapter, interleaved:
    (prompt dicts, LoRA requests, expected token ids)."""
    items, loras, expected = [], [], []
    for prompt in prompts:
        items.append({"prompt_token_ids": prompt})
        loras.append(None)
        expected.append(_reference(tiny_llama, prompt))
        for lora_id, (name, (adapter, merged)) in enumerate(peft_adapters.items(), start=1):
            items.append({"prompt_token_ids": prompt})
            loras.append(LoRARequest(name, lora_id, str(adapter)))
            expected.append(_reference(merged, prompt))
    return items, loras, expected


def check_mixed_batch(llm, tiny_llama, peft_adapters, prompts) -> list[list[int]]:
    """Generate ``_mixed_batch`` greedily with ``llm``, assert every output equals its
    reference and return the references."""
    items, loras, expected = _mixed_batch(tiny_llama, peft_adapters, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(items, params, lora_request=loras, use_tqdm=False)
    for output, lora, ref in zip(outputs, loras, expected):
        assert output.outputs[0].token_ids == ref, f"{lora and lora.lora_name} diverged"
    return expected


def _make_llm(tiny_llama, kwargs):
    lora = dict(enable_lora=True, max_lora_rank=16, max_cpu_loras=4)
    return float32_llm(tiny_llama, {**lora, **kwargs})


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_mixed_adapters_match_merged_transformers(scenario, tiny_llama, peft_adapters, tokenizer):
    llm = _make_llm(tiny_llama, SCENARIOS[scenario])
    prompts = random_prompts(PROMPT_LENGTHS, len(tokenizer), seed=7)
    expected = check_mixed_batch(llm, tiny_llama, peft_adapters, prompts)
    # The adapters matter: each changes the output of most prompts.
    base = expected[:: len(ADAPTERS) + 1]
    for k, name in enumerate(ADAPTERS, start=1):
        changed = sum(ref != b for ref, b in zip(expected[k :: len(ADAPTERS) + 1], base))
        assert changed >= len(prompts) - 1, f"{name} changes too few outputs"
    if scenario == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    check_block_accounting(llm)


def test_prefix_cache_is_per_adapter(tiny_llama, peft_adapters, tokenizer, tmp_path):
    llm = _make_llm(tiny_llama, {"max_loras": 2})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": random_prompts([50], len(tokenizer), seed=9)[0]}
    names = list(peft_adapters)
    first = LoRARequest(names[0], 1, str(peft_adapters[names[0]][0]))
    second = LoRARequest(names[1], 2, str(peft_adapters[names[1]][0]))

    def run(lora):
        return llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]

    cold = run(first)
    assert cold.num_cached_tokens == 0
    assert run(second).num_cached_tokens == 0  # another adapter: no shared blocks
    assert run(None).num_cached_tokens == 0  # nor the base model
    warm = run(first)
    assert warm.num_cached_tokens == 48 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.outputs[0].token_ids == _reference(peft_adapters[names[0]][1], prompt["prompt_token_ids"])

    # Re-written on disk with another adapter's weights, same name and id: new blocks, new output.
    moved = tmp_path / "adapter"
    shutil.copytree(peft_adapters[names[0]][0], moved)
    before = run(LoRARequest("swapped", 9, str(moved)))
    shutil.rmtree(moved)
    shutil.copytree(peft_adapters[names[1]][0], moved)
    after = run(LoRARequest("swapped", 9, str(moved)))
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == _reference(peft_adapters[names[1]][1], prompt["prompt_token_ids"])
    assert before.outputs[0].token_ids != after.outputs[0].token_ids
    check_block_accounting(llm)


def test_chat_takes_a_lora_request(tiny_llama, peft_adapters):
    llm = _make_llm(tiny_llama, {"max_loras": 1})
    name = next(iter(peft_adapters))
    lora = LoRARequest(name, 1, str(peft_adapters[name][0]))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    messages = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, params, lora_request=lora, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == _reference(peft_adapters[name][1], out.prompt_token_ids)
