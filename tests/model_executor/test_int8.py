"""``--quantization int8``: weight-only int8 with per-channel scales, applied at load. The
engine's greedy output equals transformers' on the same checkpoint with every linear weight
replaced by its dequantized values (scale * Q) with float activations
(``PAGEDLLM_CPU_INT8_ACTIVATIONS=0``); by default, on a CPU with VNNI, activations are quantized
per token for oneDNN's int8 GEMM and the log-probabilities stay close to the float ones; the
lm_head stays in the model dtype, and bad requests for a format fail at load with the
supported ones named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers.quantization.grouped import INT8_ACTIVATIONS_ENV
from pagedllm.model_executor.layers.quantization.int8 import onednn_int8_gemm_exact, quantize_int8_per_channel
from tests.helpers import assert_greedy_equals_hf, model_runner, random_prompts, rewrite_linear_weights

#: Largest change in a top-5 log-probability from per-token int8 activations on the tiny random
#: model over 6 tokens (see test_gguf.py's LOGPROB_TOLERANCE for Q8_0's blocks of 32).
LOGPROB_TOLERANCE = 0.5


def _int8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8_per_channel(weight)
    return q.float() * scale[:, None]


@pytest.fixture(scope="module")
def dequantized_llama(tiny_llama, tmp_path_factory):
    """tiny_llama with each linear weight W replaced by scale * Q (float32)."""
    return rewrite_linear_weights(tiny_llama, tmp_path_factory.mktemp("int8-dequantized"), _int8_round_trip)


def test_quantize_per_channel_round_trip():
    torch.manual_seed(0)
    w = torch.randn(40, 70)
    w[3] = 0
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (40,) and scale.dtype == torch.float32
    assert int(q.abs().max()) == 127 and scale[3] == 1 and not q[3].any()
    assert bool(((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all())


def test_int8_greedy_equals_hf_on_dequantized_weights(tiny_llama, dequantized_llama, monkeypatch):
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")  # transformers multiplies float activations
    llm = LLM(str(tiny_llama), dtype="float32", quantization="int8", kv_cache_memory_bytes=8 << 20)
    assert_greedy_equals_hf(llm, dequantized_llama)
    model = model_runner(llm).model
    quantized = [m for m in model.modules() if hasattr(m, "weight_scale")]
    assert len(quantized) == 4 * model_runner(llm).model_config.num_layers  # qkv, o, gate_up, down
    assert all(m.weight.dtype == torch.int8 for m in quantized)
    assert model.lm_head.weight.dtype == torch.float32


def test_int8_activations_stay_close_to_float_activations(tiny_llama, monkeypatch):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 40], 1000, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(INT8_ACTIVATIONS_ENV, flag)
        llm = LLM(str(tiny_llama), dtype="float32", quantization="int8", kv_cache_memory_bytes=8 << 20)
        packed = {m.weight.is_mkldnn for m in model_runner(llm).model.modules() if hasattr(m, "weight_scale")}
        assert packed == {flag == "1" and onednn_int8_gemm_exact()}
        results[flag] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    if not onednn_int8_gemm_exact():
        return
    diffs = []
    for quantized, exact in zip(results["1"], results["0"]):
        for step in range(len(exact.token_ids)):
            if quantized.token_ids[:step] != exact.token_ids[:step]:
                break
            top, near = exact.logprobs[step], quantized.logprobs[step]
            diffs += [abs(top[t].logprob - near[t].logprob) for t in set(top) & set(near)]
    assert len(diffs) >= 20 and 0 < max(diffs) < LOGPROB_TOLERANCE, diffs


def test_unknown_format_and_mismatch_fail_at_load(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"Quantization method 'int3' is not supported yet. Supported: awq, compressed-tensors, fp8, gguf, gptq, int4, int8, mxfp4, unquantized"):
        LLM(str(tiny_llama), quantization="int3", kv_cache_memory_bytes=8 << 20)
    checkpoint = tmp_path / "gptq-labelled"
    shutil.copytree(tiny_llama, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"--quantization int8 does not match the checkpoint, which is quantized as 'gptq'"):
        LLM(str(checkpoint), quantization="int8", kv_cache_memory_bytes=8 << 20)
