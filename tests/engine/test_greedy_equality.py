"""Greedy outputs are token-identical to HF transformers under every scheduling regime and
with each attention backend forced, and logprobs match transformers' log-softmax (float32)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.helpers import check_block_accounting, cpu_only, float32_llm, hf_greedy, hf_log_softmax, random_prompts

PROMPT_LENGTHS = [1, 3, 17, 32, 64, 100, 150, 200]
MAX_TOKENS = 12
ARCHS = ["tiny_llama", "tiny_llama3_rope", "tiny_qwen2", "tiny_qwen3", "tiny_mistral"]
SCENARIOS = {
    "defaults": {},
    "block_size_8": {"block_size": 8},
    "block_size_32": {"block_size": 32},
    "chunked_prefill_16": {"max_num_batched_tokens": 16},
    "max_num_seqs_2": {"max_num_seqs": 2},
    # 32 blocks of 8 tokens: exactly one max_model_len sequence; the batch needs ~80.
    "preemption": {"max_model_len": 256, "block_size": 8, "kv_blocks": 32},
    # Each attention backend forced, with steps mixing decodes and prefill chunks.
    "attention_cpu_attn": {"attention_backend": "CPU_ATTN", "max_num_batched_tokens": 64},
    "attention_torch_sdpa": {"attention_backend": "TORCH_SDPA", "max_num_batched_tokens": 64},
}


def scenario_params(names) -> list:
    """``names`` as pytest parameters; the CPU_ATTN scenario runs on CPU only."""
    return [pytest.param(name, marks=cpu_only) if name == "attention_cpu_attn" else name for name in names]


_references: dict = {}


def _reference(path, prompts):
    key = str(path)
    if key not in _references:
        _references[key] = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    return _references[key]


@pytest.mark.parametrize("scenario", scenario_params(SCENARIOS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, scenario, request, tokenizer):
    path = request.getfixturevalue(arch)
    prompts = random_prompts(PROMPT_LENGTHS, len(tokenizer), seed=1)
    llm = float32_llm(path, SCENARIOS[scenario])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = _reference(path, prompts)
    for prompt, output, ref in zip(prompts, outputs, expected):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
        assert output.outputs[0].finish_reason == "length"
    if scenario == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    if scenario == "max_num_seqs_2":
        assert llm.llm_engine.engine_core.scheduler.max_num_running_observed == 2
    check_block_accounting(llm)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_logprobs_match_transformers(arch, request, tokenizer):
    path = request.getfixturevalue(arch)
    prompts = random_prompts([5, 40, 90], len(tokenizer), seed=2)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        full = prompt + completion.token_ids
        ref = hf_log_softmax(path, full)
        # Sample logprobs: position len(prompt) - 1 + j predicts generated token j.
        assert len(completion.logprobs) == len(completion.token_ids)
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert abs(entry[token].logprob - row[token].item()) < 1e-3
            assert entry[token].rank == 1  # greedy picks the top token
            top = row.topk(5)
            for value, tid in zip(top.values.tolist(), top.indices.tolist()):
                assert abs(entry[tid].logprob - value) < 1e-3
        assert abs(completion.cumulative_logprob - sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))) < 1e-4
        # Prompt logprobs: None for the first token, then token i scored at position i - 1.
        assert output.prompt_logprobs[0] is None
        assert len(output.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            entry = output.prompt_logprobs[i]
            assert abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-3
            expected_rank = int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1
            assert entry[prompt[i]].rank == expected_rank
            assert len(entry) in (3, 4)  # top-3 plus the actual token unless it is among them
    check_block_accounting(llm)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_bfloat16_logprobs_track_transformers(arch, request, tokenizer, monkeypatch):
    """In bf16 (packed weights; decode steps of few rows through ``packed_linear`` where the
    CPU has AVX512-BF16), generated tokens' logprobs are about as far from transformers'
    float32 values as transformers' own bf16 model is (per-token errors of both scatter, up
    to ~0.15 on these random models, so the bound is on their mean and maximum)."""
    from transformers import AutoModelForCausalLM

    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.model_executor.layers import cpu_gemm

    calls = []
    real = cpu_kernels.packed_linear
    if cpu_kernels.is_available():
        # linear()'s calls, not the layout check's probes (made before a shape is accepted)
        monkeypatch.setattr(
            cpu_kernels,
            "packed_linear",
            lambda *a: calls.append(tuple(a[1].shape) in cpu_gemm._packed_linear_shapes) or real(*a),
        )
    path = request.getfixturevalue(arch)
    prompts = random_prompts([7, 60, 130], len(tokenizer), seed=3)
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours, theirs = [], []
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        full = prompt + completion.token_ids
        ref = hf_log_softmax(path, full)
        with torch.inference_mode():
            ref_bf16 = torch.log_softmax(hf_bf16(torch.tensor([full])).logits[0].float(), dim=-1)
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            pos = len(prompt) - 1 + j
            ours.append(abs(entry[token].logprob - ref[pos, token].item()))
            theirs.append(abs(ref_bf16[pos, token].item() - ref[pos, token].item()))
    assert len(ours) == 24
    assert sum(ours) / len(ours) <= 1.5 * sum(theirs) / len(theirs) + 0.01, (ours, theirs)
    assert max(ours) <= 2 * max(theirs) + 0.02, (ours, theirs)
    # The path this machine takes: packed_linear wherever its layout check accepted the shapes.
    assert any(calls) == bool(cpu_gemm._packed_linear_shapes), (calls, cpu_gemm._packed_linear_shapes)
