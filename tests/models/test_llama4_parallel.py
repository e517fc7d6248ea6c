"""Llama 4 (text; ``tests/models/test_llama4.py``'s checkpoint: chunked local attention, a NoPE
layer, dense and expert layers interleaved) over two tensor-parallel workers (``-tp 2``: each
expert split by its intermediate dimension; ``--enable-expert-parallel``: 2 whole experts per
worker) greedy token-identical to transformers (float32) with prefix hits and preemption, under
``--quantization int8`` equal to transformers on the dequantized weights, and in bfloat16 close
to transformers bfloat16 (vLLM's ``check_logprobs_close`` criterion)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.quantization.grouped import INT8_ACTIVATIONS_ENV
from tests.helpers import (
    assert_greedy_equals_hf,
    can_host_workers,
    check_block_accounting,
    model_runner,
    random_prompts,
    rewrite_linear_weights,
)
from tests.model_executor.test_int8 import _int8_round_trip
from tests.models.test_llama4 import CONFIG
from tests.models.utils import assert_moe_over_workers, prompts_for

two_workers = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")
#: 16-token steps over 8-token blocks, 40 blocks: chunks crossing the 24-token attention
#: chunks, preemption of the batch (the prompts twice) and prefix hits on the second pass.
TP_KWARGS = dict(dtype="float32", tensor_parallel_size=2, max_model_len=128, block_size=8,
                 max_num_batched_tokens=16, num_gpu_blocks_override=40, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def llama4(checkpoint_factory):
    return checkpoint_factory("Llama4ForCausalLM", seed=2, **CONFIG)


@two_workers
@pytest.mark.parametrize("enable_expert_parallel", [False, True], ids=["tp", "ep"])
def test_two_workers_equal_transformers(llama4, enable_expert_parallel):
    # Experts on layers 1 and 3: 4 of them, intermediate size 32.
    shards = [(0, 2, 32), (2, 2, 32)] if enable_expert_parallel else [(0, 4, 16), (0, 4, 16)]
    assert_moe_over_workers(llama4, prompts_for(1024), shards, 2, enable_expert_parallel=enable_expert_parallel,
                            **TP_KWARGS)


def _dequantized(src, out):
    """``src`` with every linear and expert weight replaced by its int8 round trip (per output
    channel; the stacked experts ``[E, in, out]`` per expert, transposed)."""
    rewrite_linear_weights(src, out, _int8_round_trip)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name] = torch.stack([_int8_round_trip(w.t().float()).t() for w in tensor]).to(tensor.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def test_int8_equals_transformers_on_dequantized_weights(llama4, tmp_path, monkeypatch):
    """``--quantization int8``: attention, dense MLP, shared expert and the stacked experts in
    int8 (the router kept); greedy output equals transformers' on the dequantized weights."""
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")  # transformers multiplies float activations
    dequantized = _dequantized(llama4, tmp_path / "dequantized")
    llm = LLM(str(llama4), dtype="float32", quantization="int8", kv_cache_memory_bytes=8 << 20, block_size=8,
              max_num_batched_tokens=16)
    experts = [m for m in model_runner(llm).model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and not any(hasattr(m, "w13_weight") for m in experts)
    assert_greedy_equals_hf(llm, dequantized)
    check_block_accounting(llm)


def _hf_bf16_greedy(path, prompt: list[int], num_tokens: int, top_k: int) -> tuple[list[int], list[list[int]]]:
    """transformers bfloat16 greedy tokens and each step's ``top_k`` token ids."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids, tops = list(prompt), []
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            tops.append(logits.topk(top_k).indices.tolist())
            ids.append(tops[-1][0])
    return ids[len(prompt):], tops


def test_bfloat16_close_to_transformers_bfloat16(llama4):
    """bfloat16 rounds differently in each implementation: the greedy tokens are identical up
    to their first difference, where each side's token is among the other's top 5."""
    llm = LLM(str(llama4), dtype="bfloat16", kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    prompts = random_prompts([5, 30, 60], 1000, seed=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    num_identical = 0
    for prompt, output in zip(prompts, outputs):
        got = list(output.outputs[0].token_ids)
        expected, tops = _hf_bf16_greedy(llama4, prompt, 8, 5)
        step = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(got))
        num_identical += step
        if step < len(got):
            assert got[step] in tops[step] and expected[step] in output.outputs[0].logprobs[step], (
                f"step {step}: {got} vs transformers' {expected}")
    assert num_identical >= 8, "bfloat16 diverged from transformers at once on every prompt"
    check_block_accounting(llm)
