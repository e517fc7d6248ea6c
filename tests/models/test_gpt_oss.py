"""gpt-oss: greedy token-identical to transformers (float32) under chunked prefill, preemption
and prefix caching (attention sinks, alternating 16-token windows, YaRN rope, biased router and
experts with a clamped SwiGLU whose clamp the activations reach); an MXFP4 checkpoint (the
experts quantized by an encoder of the OCP MX spec) loads dequantized and equals transformers
on the dequantized weights; over two tensor-parallel workers the output is the same."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.model_executor.layers.quantization import mxfp4 as mxfp4_module
from pagedllm.model_executor.layers.quantization.mxfp4 import E2M1_VALUES, MXFP4_BLOCK, dequantize_mxfp4
from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers.activation import SwigluOAIAndMul
from tests.helpers import can_host_workers, check_block_accounting, float32_llm
from tests.models.utils import MAX_TOKENS, SCENARIOS, assert_scenario, prompts_for, transformers_greedy

# swiglu_limit 1.0: the expert activations (std ~0.7 here) pass the clamp often. YaRN as the
# published configs (no truncation), its original context 64 tokens: the prompts pass it.
YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=64, rope_theta=150000.0)
CONFIG = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, num_hidden_layers=2,
              sliding_window=16, swiglu_limit=1.0, swiglu_alpha=1.5, rope_parameters=YARN, rope_theta=150000.0,
              max_position_embeddings=256)


@pytest.fixture(scope="module")
def gpt_oss(checkpoint_factory):
    return checkpoint_factory("GptOssForCausalLM", seed=3, **CONFIG)


#: The windowed and full layers keep separate block tables (KV-cache groups): a 128-token
#: sequence may take 33 blocks of 8, so the preemption scenario gets 40 (the batch needs ~76).
SCENARIO_KWARGS = {"preemption": {"kv_blocks": 40}}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_transformers(gpt_oss, scenario):
    assert_scenario(gpt_oss, scenario, prompts_for(1024), **SCENARIO_KWARGS.get(scenario, {}))


def test_clamped_swiglu_equals_transformers():
    """``SwigluOAIAndMul`` on [gate | up] equals ``GptOssExperts._apply_gate`` on the interleaved
    columns, values on both sides of the clamps included."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=1, swiglu_alpha=1.3, swiglu_limit=2.0)
    gate_up = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)) * 4
    expected = GptOssExperts(config)._apply_gate(gate_up)
    halves = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=-1)
    assert torch.equal(SwigluOAIAndMul(1.3, 2.0).forward_native(halves), expected)


def _encode_mxfp4(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] float -> (blocks uint8 [..., rows, cols / 32, 16], scales uint8
    [..., rows, cols / 32]) by the OCP MX spec: a block's shared scale 2^(floor(log2 amax) - 2)
    (e2m1's largest exponent is 2), each element the nearest E2M1 value of x / scale (saturating
    at +-6), two codes a byte, the even element in the low nibble."""
    *lead, rows, cols = matrix.shape
    x = matrix.float().reshape(*lead, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-126)
    exponent = torch.floor(torch.log2(amax)) - 2
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    scaled = (x / torch.exp2(exponent)).clamp(-6.0, 6.0)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1) | ((scaled < 0).long() << 3)
    codes = codes.to(torch.uint8).reshape(*x.shape[:-1], MXFP4_BLOCK // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def _write_like(source, target, tensors: dict, config_edit=None):
    """A copy of checkpoint folder ``source`` at ``target`` holding ``tensors`` (config.json
    edited by ``config_edit``)."""
    shutil.copytree(source, target)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    if config_edit is not None:
        config = json.loads((target / "config.json").read_text())
        config_edit(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


def test_mxfp4_checkpoint_loads_dequantized(gpt_oss, tmp_path, caplog):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weights, quantized, dequantized = load_file(gpt_oss / "model.safetensors"), {}, {}
    for name, tensor in weights.items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            quantized[name] = dequantized[name] = tensor
            continue
        blocks, scales = _encode_mxfp4(tensor.transpose(1, 2).contiguous())  # [E, out, in], as published
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' reading
        assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2), dequantized[name])
        assert not torch.equal(dequantized[name], tensor)  # really quantized
    reference = _write_like(gpt_oss, tmp_path / "dequantized", dequantized)
    mxfp4 = _write_like(gpt_oss, tmp_path / "mxfp4", quantized, lambda config: config.update(quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}))
    with caplog.at_level(logging.WARNING, logger=mxfp4_module.__name__):
        llm = float32_llm(mxfp4, SCENARIOS["chunked_prefill"])
    assert any("MXFP4 weights are dequantized to float32" in r.getMessage() for r in caplog.records)
    assert_scenario(reference, "chunked_prefill", prompts_for(1024, lengths=(17, 90)), llm=llm)


@pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")
def test_greedy_equals_transformers_over_two_tensor_parallel_workers(gpt_oss):
    """Each worker holds half the heads' sinks and half of each expert's columns and W13 bias;
    W2's bias is added once."""
    prompts = prompts_for(1024)
    llm = LLM(str(gpt_oss), dtype="float32", tensor_parallel_size=2, max_model_len=128, block_size=8,
              max_num_batched_tokens=64)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == transformers_greedy(gpt_oss, prompts)
        check_block_accounting(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
