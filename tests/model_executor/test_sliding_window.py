"""Sliding-window attention against transformers: Mistral with ``sliding_window`` 16 on every
layer, and Qwen2 with ``use_sliding_window`` / ``max_window_layers`` 1 (layer 0 full, layer 1
windowed). Greedy output token-identical under chunked prefill, prefix-cache hits and
preemption, with TORCH_SDPA named and with the automatic choice (CPU_ATTN, the C++ kernel,
on CPU); prompt logprobs equal at every position (so at W - 1, W and W + 1 one by one);
``--disable-sliding-window``."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.worker.kv_cache_sizing import kv_cache_groups
from tests.helpers import check_block_accounting, float32_llm, hf_greedy, hf_log_softmax, model_runner, random_prompts

WINDOW = 16
MAX_TOKENS = 10
#: ~60 tokens (far past the window), and prompts ending at W - 1, W and W + 1, whose decodes
#: cross the window's edge.
PROMPT_LENGTHS = [60, WINDOW - 1, WINDOW, WINDOW + 1]
ARCHS = {
    "mistral": ("MistralForCausalLM", {"sliding_window": WINDOW, "seed": 31}),
    "qwen2_mixed": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": WINDOW,
                                         "max_window_layers": 1, "seed": 32}),
}
SCENARIOS = {
    "auto_chunked_8": {"max_num_batched_tokens": 8},
    "torch_sdpa_chunked_16": {"attention_backend": "TORCH_SDPA", "max_num_batched_tokens": 16},
    # Blocks of 8 tokens, room for one request at its longest and one block more (a
    # windowed group frees what falls out of the window: the block count is the model's,
    # ``_one_request_blocks``): the batch needs more, so requests are preempted and recomputed.
    "preemption": {"max_model_len": 96, "block_size": 8, "max_num_batched_tokens": 16},
    # --batch-invariant: every token attended alone over its own window (the kernel's per-token path).
    "batch_invariant_chunked_8": {"batch_invariant": True, "max_num_batched_tokens": 8},
}

_references: dict = {}


@pytest.fixture(scope="module", params=list(ARCHS))
def windowed(request, checkpoint_factory):
    arch, kwargs = ARCHS[request.param]
    return checkpoint_factory(arch, **kwargs)


def _expected(path, prompts):
    key = str(path)
    if key not in _references:
        _references[key] = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    return _references[key]


def _one_request_blocks(path, kwargs) -> int:
    """Blocks one request of ``max_model_len`` tokens holds at most, over the KV-cache groups."""
    config = EngineArgs(model=str(path), **kwargs).create_engine_config()
    return kv_cache_groups(config).max_num_blocks_per_request(kwargs["max_model_len"], kwargs["max_num_batched_tokens"])


def _generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_windowed_greedy_matches_transformers(windowed, scenario, tokenizer):
    prompts = random_prompts(PROMPT_LENGTHS, len(tokenizer), seed=7)
    expected = _expected(windowed, prompts)
    kwargs = dict(SCENARIOS[scenario])
    if scenario == "preemption":
        kwargs["kv_blocks"] = _one_request_blocks(windowed, kwargs) + 1
    llm = float32_llm(windowed, kwargs)
    # Both backends have windows: the automatic choice is CPU_ATTN's kernel (CPU).
    assert model_runner(llm).attn_backend.get_name() == SCENARIOS[scenario].get("attention_backend", "CPU_ATTN")
    windows = [layer.sliding_window for layer in model_runner(llm).attention_layers]
    assert windows == ([WINDOW, WINDOW] if "Mistral" in llm.llm_engine.config.model_config.architecture else [None, WINDOW])
    for run in range(2):  # the second run hits the prefix cache
        outputs = _generate(llm, prompts)
        for prompt, output, ref in zip(prompts, outputs, expected):
            assert output.outputs[0].token_ids == ref, f"run {run}: prompt of {len(prompt)} tokens diverged"
        if run and scenario != "preemption":
            assert outputs[0].num_cached_tokens >= 48
    if scenario == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    check_block_accounting(llm)


def test_windowed_prompt_logprobs_at_every_position(windowed, tokenizer):
    """Each prompt position's logprob of the next token equals transformers' (chunks of 8
    tokens, so positions W - 1, W, W + 1 fall in different chunks)."""
    prompt = random_prompts([40], len(tokenizer), seed=8)[0]
    llm = LLM(str(windowed), dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    ref = hf_log_softmax(windowed, prompt)
    for i in range(1, len(prompt)):
        got = output.prompt_logprobs[i][prompt[i]].logprob
        assert abs(got - ref[i - 1, prompt[i]].item()) < 1e-3, f"position {i - 1}"
    check_block_accounting(llm)


def test_disable_sliding_window_caps_max_model_len_and_attends_fully(windowed, tokenizer):
    """vLLM's ``--disable-sliding-window``: max_model_len capped at the window (a larger one is
    refused), every layer full attention (so CPU_ATTN may run), the same output within the window."""
    config = EngineArgs(model=str(windowed), disable_sliding_window=True).create_engine_config()
    assert config.model_config.max_model_len == WINDOW and config.model_config.sliding_window is None
    assert EngineArgs(model=str(windowed)).create_engine_config().model_config.max_model_len == 2048
    with pytest.raises(ValueError, match=r"max_model_len \(32\) is larger .* \(16, the sliding window"):
        EngineArgs(model=str(windowed), disable_sliding_window=True, max_model_len=32).create_engine_config()
    llm = LLM(str(windowed), dtype="float32", kv_cache_memory_bytes=16 << 20, disable_sliding_window=True)
    assert [layer.sliding_window for layer in model_runner(llm).attention_layers] == [None, None]
    prompt = random_prompts([9], len(tokenizer), seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=WINDOW - 9, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == hf_greedy(windowed, prompt, WINDOW - 9)
    check_block_accounting(llm)
