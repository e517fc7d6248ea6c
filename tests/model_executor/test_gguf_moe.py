"""GGUF files of mixture-of-experts models, as llama.cpp writes them (stacked expert tensors
``blk.N.ffn_{gate,up,down}_exps.weight`` [E, rows, inputs], the router ``ffn_gate_inp``, the
expert counts in the metadata): the experts are split per expert at load and run on the grouped
integer kernels in their blocks' own arithmetic (W13 and W2 each at its own layout), or
dequantized at load for types without a kernel.

Qwen3-MoE and Qwen2-MoE (with its shared expert): greedy output equals transformers' own GGUF
loading of the same file (transformers does not read ``expert_feed_forward_length`` /
``expert_shared_feed_forward_length``: it is given ``moe_intermediate_size`` /
``shared_expert_intermediate_size``). Mixtral
(architecture "llama" with experts): transformers reads the file as a dense Llama, so the
reference is transformers on the checkpoint with every linear and expert weight replaced by
its GGUF round trip (``gguf``'s quantize then dequantize). A file that lacks an expert tensor
or holds one of the wrong shape fails at load, named."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.quantization.grouped import INT8_ACTIVATIONS_ENV
from tests.fixtures.gguf_kquant_writer import quantize_k
from tests.fixtures.gguf_writer import write_gguf
from tests.helpers import (LINEAR_SUFFIXES, MIXTRAL_EXPERT_SUFFIXES, assert_greedy_equals_hf, check_block_accounting,
                           model_runner, random_prompts, rewrite_linear_weights)

PROMPTS = random_prompts([5, 17, 40], 1000, seed=3)
#: Hidden and expert sizes of 256: whole K-quant super-blocks for W13's and W2's inputs.
QWEN3_MOE = dict(hidden_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                 intermediate_size=256, norm_topk_prob=True)
QWEN2_MOE = {**QWEN3_MOE, "shared_expert_intermediate_size": 256}
MIXTRAL = dict(hidden_size=256, num_local_experts=8, num_experts_per_tok=2, intermediate_size=256)


@pytest.fixture(scope="module")
def qwen3_moe(checkpoint_factory):
    return checkpoint_factory("Qwen3MoeForCausalLM", seed=9, **QWEN3_MOE)


@pytest.fixture(scope="module")
def qwen2_moe(checkpoint_factory):
    """With its gated shared expert (``ffn_*_shexp``, ``ffn_gate_inp_shexp`` [H])."""
    return checkpoint_factory("Qwen2MoeForCausalLM", seed=9, **QWEN2_MOE)


@pytest.fixture(scope="module")
def mixtral(checkpoint_factory):
    return checkpoint_factory("MixtralForCausalLM", seed=9, **MIXTRAL)


@pytest.fixture(scope="module")
def small_mixtral(checkpoint_factory):
    """Sizes of whole Q8_0 blocks (32 inputs), not K-quant super-blocks: a faster model."""
    return checkpoint_factory("MixtralForCausalLM", seed=9, **{**MIXTRAL, "hidden_size": 64, "intermediate_size": 64})


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")  # transformers multiplies float32 activations


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _hf_gguf_greedy(path, **config) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, **config)
    outputs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                        do_sample=False, pad_token_id=0)  # fmt: skip
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def _experts(llm: LLM) -> list[FusedMoE]:
    return [m for m in model_runner(llm).model.modules() if isinstance(m, FusedMoE)]


def _layout(matrix) -> tuple[int, int]:
    return matrix.weight_bits, matrix.input_size_per_partition // matrix.weight_scale.shape[1]


@pytest.mark.parametrize(
    "linear_type,module_types,w13,w2",
    [
        ("Q8_0", None, (8, 32), (8, 32)),
        ("Q4_K", None, (4, 32), (4, 32)),
        ("Q4_K", {"ffn_down_exps": "Q6_K"}, (4, 32), (8, 16)),  # llama.cpp's Q4_K_M keeps some ffn_down in Q6_K
        ("TQ2_0", None, None, None),  # no ternary kernel: float experts, dequantized at load
    ],
)
def test_qwen3_moe_gguf_equals_transformers_gguf(qwen3_moe, tmp_path, linear_type, module_types, w13, w2):
    path = write_gguf(qwen3_moe, tmp_path / f"qwen3-moe-{linear_type}.gguf", linear_type, "F32", module_types)
    llm = LLM(str(path), tokenizer=str(qwen3_moe), dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert model_runner(llm).model_config.architecture == "Qwen3MoeForCausalLM"
    experts = _experts(llm)
    assert len(experts) == 2
    if w13 is None:
        # Float experts: the stacked weights, or their blocks for the fused kernel (kernels on).
        assert all(getattr(m, "w13_packed", getattr(m, "w13_weight", None)).dtype == torch.float32 for m in experts)
    else:
        assert {_layout(matrix) for m in experts for matrix in m.w13_experts} == {w13}
        assert {_layout(matrix) for m in experts for matrix in m.w2_experts} == {w2}
    assert _greedy(llm) == _hf_gguf_greedy(path, moe_intermediate_size=QWEN3_MOE["moe_intermediate_size"])
    check_block_accounting(llm)


@pytest.mark.parametrize("linear_type", ["Q8_0", "Q4_K"])
def test_qwen2_moe_gguf_equals_transformers_gguf(qwen2_moe, tmp_path, linear_type):
    path = write_gguf(qwen2_moe, tmp_path / f"qwen2-moe-{linear_type}.gguf", linear_type, "F32")
    llm = LLM(str(path), tokenizer=str(qwen2_moe), dtype="float32", kv_cache_memory_bytes=8 << 20)
    model = model_runner(llm).model
    assert model_runner(llm).model_config.architecture == "Qwen2MoeForCausalLM"
    bits = 8 if linear_type == "Q8_0" else 4
    assert {_layout(matrix)[0] for m in _experts(llm) for matrix in (*m.w13_experts, *m.w2_experts)} == {bits}
    shared = [m for name, m in model.named_modules() if name.endswith("shared_expert.gate_up_proj")]
    assert len(shared) == 2 and all(m.weight_bits == bits for m in shared)
    sizes = {k: QWEN2_MOE[k] for k in ("moe_intermediate_size", "shared_expert_intermediate_size")}
    assert _greedy(llm) == _hf_gguf_greedy(path, **sizes)
    check_block_accounting(llm)


def _gguf_round_trip(type_name: str):
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]

    def round_trip(weight: torch.Tensor) -> torch.Tensor:
        w = weight.numpy().astype(np.float32)
        raw = quantize_k(w, type_name) if type_name.endswith("_K") else gguf.quants.quantize(w, qtype)
        return torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), copy=True)).reshape(weight.shape)

    return round_trip


@pytest.mark.parametrize("model,linear_type", [("small_mixtral", "Q8_0"), ("mixtral", "Q4_K")])
def test_mixtral_gguf_equals_transformers_on_dequantized_weights(request, tmp_path, model, linear_type):
    mixtral = request.getfixturevalue(model)
    path = write_gguf(mixtral, tmp_path / f"mixtral-{linear_type}.gguf", linear_type, "F32")
    reference = rewrite_linear_weights(mixtral, tmp_path / "dequantized", _gguf_round_trip(linear_type),
                                       LINEAR_SUFFIXES + MIXTRAL_EXPERT_SUFFIXES)
    llm = LLM(str(path), tokenizer=str(mixtral), dtype="float32", kv_cache_memory_bytes=8 << 20)
    config = model_runner(llm).model_config
    assert config.architecture == "MixtralForCausalLM" and config.hf_config.num_local_experts == 8
    bits = 8 if linear_type == "Q8_0" else 4
    assert {_layout(matrix)[0] for m in _experts(llm) for matrix in (*m.w13_experts, *m.w2_experts)} == {bits}
    assert_greedy_equals_hf(llm, reference)
    check_block_accounting(llm)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda name, t: None if name == "blk.1.ffn_up_exps.weight" else t,
         r"lacks expert weights of model\.layers\.1\.mlp\.experts: expert 0 w3"),
        (lambda name, t: t[:7] if name == "blk.0.ffn_down_exps.weight" else t,
         r"lacks expert weights of model\.layers\.0\.mlp\.experts: expert 7 w2"),
        (lambda name, t: t[:, :128] if name == "blk.0.ffn_gate_exps.weight" else t,
         r"'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.qweight'.*dimension 0 should be 256"),
    ],
    ids=["missing", "fewer-experts", "wrong-rows"],
)
def test_malformed_expert_tensors_are_refused_by_name(qwen3_moe, tmp_path, edit, message):
    path = write_gguf(qwen3_moe, tmp_path / "bad.gguf", "Q8_0", "F32", edit_experts=edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), tokenizer=str(qwen3_moe), dtype="float32", kv_cache_memory_bytes=8 << 20)
