"""``--batch-invariant``: a prompt's greedy tokens and logprobs are bit-identical whatever the
prefix cache's state (cold, or its start cached), the prefill chunk size, the other requests
of the batch and preemption — on the CPU kernels at every instruction-set level this host
runs, and on the portable path (TORCH_SDPA, no kernels). Each scenario ends with the
block-accounting check. (Without the mode the comparison can differ: the default kernels
depend on the row count; ``benchmarks/batch_invariance.py`` measures by how much.)"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import check_block_accounting, kv_block_bytes, random_prompts

MAX_TOKENS = 10
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _prompts(vocab_size: int) -> list[list[int]]:
    """Prompts that share a 40-token start (prefix-cache hits) and ones that do not."""
    shared = random_prompts([40], vocab_size, seed=7)[0]
    tails = random_prompts([9, 23, 1, 30], vocab_size, seed=8)
    return [shared + tails[0], shared + tails[1], *random_prompts([57, 3], vocab_size, seed=9), shared + tails[2],
            shared + tails[3]]  # fmt: skip


def _results(outputs) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per request: its tokens and, per token, {token id: logprob} of its top 5 (exact floats)."""
    results = []
    for output in outputs:
        completion = output.outputs[0]
        results.append((completion.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]))
    return results


def _alone(path, prompts, **kwargs) -> list:
    """Each prompt in an engine of its own call, one at a time, no prefix caching, whole-prompt steps."""
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False, **kwargs)
    results = [_results(llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False))[0] for p in prompts]
    check_block_accounting(llm)
    return results


def _under_pressure(path, prompts, **kwargs) -> tuple[list, list, LLM]:
    """All prompts at once, twice (the second time their starts are cached: asserted), in
    16-token steps, with a KV cache too small for the batch (preemption)."""
    probe = LLM(str(path), kv_cache_memory_bytes=16 << 20, **kwargs)
    block_bytes = kv_block_bytes(probe)
    del probe
    llm = LLM(str(path), kv_cache_memory_bytes=15 * block_bytes, block_size=16, max_num_batched_tokens=16,
              max_model_len=128, **kwargs)  # fmt: skip
    cold = _results(llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False))
    warm_outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert sum(output.num_cached_tokens for output in warm_outputs) > 0
    return cold, _results(warm_outputs), llm


def _check_bit_identical(path, tokenizer, **kwargs) -> None:
    prompts = _prompts(len(tokenizer))
    reference = _alone(path, prompts, batch_invariant=True, **kwargs)
    cold, warm, llm = _under_pressure(path, prompts, batch_invariant=True, **kwargs)
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0
    for i, (ref, got_cold, got_warm) in enumerate(zip(reference, cold, warm)):
        assert got_cold == ref, f"prompt {i} ({len(prompts[i])} tokens): batched cold run differs from alone"
        assert got_warm == ref, f"prompt {i} ({len(prompts[i])} tokens): warm (cached) run differs from alone"
    check_block_accounting(llm)


def test_bit_identical_on_cpu_kernels_at_every_level(isa_kernel, tiny_llama, tokenizer):
    _check_bit_identical(tiny_llama, tokenizer, dtype="bfloat16", attention_backend="CPU_ATTN")


def test_bit_identical_in_float32_with_kernels(tiny_qwen2, tokenizer):
    """float32 weights (``pack_w32``), TORCH_SDPA's per-token attention beside the kernels' linears."""
    _check_bit_identical(tiny_qwen2, tokenizer, dtype="float32", attention_backend="TORCH_SDPA")


def test_bit_identical_over_an_fp8_kv_cache(tiny_llama, tokenizer):
    """A prompt attends over the K/V at the cache's precision whether they were written in
    this step or found in the cache: over an FP8 cache too, cold and warm runs agree."""
    _check_bit_identical(tiny_llama, tokenizer, dtype="bfloat16", attention_backend="CPU_ATTN", kv_cache_dtype="fp8")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bit_identical_on_the_portable_path(disable_cpu_kernels, tiny_qwen2, tokenizer, dtype):
    disable_cpu_kernels()
    _check_bit_identical(tiny_qwen2, tokenizer, dtype=dtype, attention_backend="TORCH_SDPA")


def test_refused_with_a_quantized_model(tiny_llama):
    with pytest.raises(ValueError, match="--batch-invariant supports unquantized models only"):
        LLM(str(tiny_llama), batch_invariant=True, quantization="int8", kv_cache_memory_bytes=16 << 20)


def test_refused_with_lora(tiny_llama):
    with pytest.raises(ValueError, match="batch_invariant is not supported yet with enable_lora"):
        LLM(str(tiny_llama), batch_invariant=True, enable_lora=True)


@pytest.mark.parametrize("name", ["VLLM_BATCH_INVARIANT", "PAGEDLLM_BATCH_INVARIANT"])
def test_the_environment_variable_turns_it_on(monkeypatch, tiny_llama, name):
    """vLLM's ``VLLM_BATCH_INVARIANT=1`` (or ours) acts as the flag: the linears go row by row,
    and what the flag refuses is refused."""
    monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match="batch_invariant is not supported yet with enable_lora"):
        LLM(str(tiny_llama), enable_lora=True)
    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.config.model_config.batch_invariant
    layer = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model.model.layers[0]
    assert type(layer.mlp.down_proj.quant_method).__name__ == "BatchInvariantLinearMethod"
