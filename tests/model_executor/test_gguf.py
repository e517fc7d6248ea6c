"""GGUF files load and run: ``LLM("model.gguf", tokenizer=HF_DIR)`` reads the architecture and
hyper-parameters from the file's metadata, maps GGUF tensor names back to Hugging Face's
(Llama's q / k rows un-permuted), runs Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and the K-quants Q4_K / Q5_K / Q6_K
linear weights on the grouped integer kernels and dequantizes other types at load; greedy output
equals transformers' own GGUF loading (which dequantizes everything) on the same file, and the
decoded blocks equal ``gguf.quants.dequantize``. The files are written by
``tests.fixtures.gguf_writer`` with the ``gguf`` package's writer and quantizers (K-quants by
``tests.fixtures.gguf_kquant_writer``, which gguf cannot write)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.gguf_weights import decode_blocks, unpermute_rows
from pagedllm.model_executor.layers.quantization.grouped import INT8_ACTIVATIONS_ENV
from tests.fixtures.gguf_kquant_writer import quantize_k
from tests.fixtures.gguf_writer import permute_rows, write_gguf
from tests.helpers import cpu_only, model_runner, random_prompts

PROMPTS = random_prompts([5, 17, 40], 1000, seed=3)
#: Largest change in a top-5 log-probability from int8 activations on the tiny random model
#: over 5 decode steps (measured 0.33 nats for Q8_0 and 0.35 for Q4_0: its random weights give
#: sharp, large logits; each activation moves by at most max|x over its 32| / 254 per layer,
#: the kernel tests check that bound). A wrong kernel moves them by whole nats.
LOGPROB_TOLERANCE = 0.5


def _hf_gguf_greedy(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def qwen2_128(checkpoint_factory):
    return checkpoint_factory("Qwen2ForCausalLM", seed=6, hidden_size=128, intermediate_size=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def llama_256(checkpoint_factory):
    """Linear inputs (256, 512) that are whole K-quant super-blocks."""
    return checkpoint_factory("LlamaForCausalLM", seed=8, hidden_size=256, intermediate_size=512)


def _layers(llm: LLM) -> dict[str, torch.nn.Module]:
    model = model_runner(llm).model
    return {name: m for name, m in model.named_modules() if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}


@pytest.mark.parametrize(
    "model,linear_type,other_type,weight_dtype",
    [
        ("llama_128", "Q4_0", "F32", torch.uint8),
        ("llama_128", "Q4_1", "F16", torch.uint8),
        ("llama_128", "Q8_0", "F32", torch.uint8),
        ("llama_128", "Q5_0", "F32", torch.uint8),
        ("llama_128", "Q5_1", "F16", torch.uint8),
        ("llama_256", "TQ2_0", "F32", torch.float32),  # no ternary kernel: dequantized at load
        ("qwen2_128", "Q4_0", "F32", torch.uint8),
        ("llama_256", "Q4_K", "F32", torch.uint8),
        ("llama_256", "Q5_K", "F16", torch.uint8),
        ("llama_256", "Q6_K", "F32", torch.uint8),
    ],
)
def test_greedy_equals_transformers_gguf(request, tmp_path, monkeypatch, model, linear_type, other_type, weight_dtype):
    # transformers multiplies float32 activations: so do we here (int8 ones: the test below).
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")
    checkpoint = request.getfixturevalue(model)
    path = write_gguf(checkpoint, tmp_path / f"model-{linear_type}.gguf", linear_type, other_type)
    llm = LLM(str(path), tokenizer=str(checkpoint), dtype="float32", kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert list(output.outputs[0].token_ids) == _hf_gguf_greedy(path, prompt, 8)
    runner = model_runner(llm)
    assert {m.weight.dtype for m in _layers(llm).values()} == {weight_dtype}
    assert runner.model_config.hf_config.num_hidden_layers == 2 and runner.model_config.architecture.endswith("ForCausalLM")


@cpu_only  # the int8 activations are the CPU kernels'
@pytest.mark.parametrize("linear_type", ["Q8_0", "Q4_0"])
def test_int8_activations_stay_close_to_float_activations(llama_128, tmp_path, monkeypatch, linear_type):
    # Decode with int8 activations (the default, llama.cpp's arithmetic) against the exact
    # float32-activation product on the same file: at each decode step (3 rows, so the
    # few-row kernels) while the two outputs agree so far, the log-probabilities of the float
    # path's top tokens agree closely. (The first token comes from the batched prefill, more
    # than 16 rows: float32 activations in both.)
    path = write_gguf(llama_128, tmp_path / f"model-{linear_type}.gguf", linear_type, "F32")
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(INT8_ACTIVATIONS_ENV, flag)
        llm = LLM(str(path), tokenizer=str(llama_128), dtype="float32", kv_cache_memory_bytes=8 << 20)
        layers = [m for m in model_runner(llm).model.modules() if hasattr(m, "int8_activations")]
        assert layers and all(m.int8_activations == (flag == "1") for m in layers)
        results[flag] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    diffs = []
    for quantized, exact in zip(results["1"], results["0"]):
        for step in range(1, len(exact.token_ids)):
            if quantized.token_ids[:step] != exact.token_ids[:step]:
                break
            top, near = exact.logprobs[step], quantized.logprobs[step]
            diffs += [abs(top[t].logprob - near[t].logprob) for t in set(top) & set(near)]
    assert len(diffs) >= 20 and 0 < max(diffs) < LOGPROB_TOLERANCE, diffs


def test_q4_k_m_mix_runs_fused_layers_at_their_parts_widest_layout(llama_256, tmp_path, caplog, monkeypatch):
    """As llama.cpp's Q4_K_M: v_proj and down_proj in Q6_K, the rest Q4_K. The fused q/k/v
    layer then stores 8 bits in groups of 16 (Q4_K's scales repeated), gate/up stays int4."""
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")  # transformers multiplies float32 activations
    mix = {"v_proj": "Q6_K", "down_proj": "Q6_K"}
    path = write_gguf(llama_256, tmp_path / "model-Q4_K_M.gguf", "Q4_K", "F16", module_types=mix)
    with caplog.at_level("INFO"):
        llm = LLM(str(path), tokenizer=str(llama_256), dtype="float32", kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert list(output.outputs[0].token_ids) == _hf_gguf_greedy(path, prompt, 8)
    layouts = {name.rpartition(".")[2]: (m.weight_bits, m.input_size // m.weight_scale.shape[1]) for name, m in _layers(llm).items()}
    assert layouts == {"qkv_proj": (8, 16), "o_proj": (4, 32), "gate_up_proj": (4, 32), "down_proj": (8, 16)}
    assert "Q4_K linear weights run on linear_w4 (int4, groups of 32) and linear_w8g (int8, groups of 16)" in caplog.text
    assert "Q6_K linear weights run on linear_w8g (int8, groups of 16)" in caplog.text


@pytest.mark.parametrize(
    "type_name,group",
    [("Q4_0", 32), ("Q4_1", 32), ("Q5_0", 32), ("Q5_1", 32), ("Q8_0", 32), ("Q8_0", 16), ("Q4_K", 32), ("Q4_K", 16),
     ("Q5_K", 32), ("Q6_K", 16)],
)
def test_decoded_blocks_equal_gguf_dequantize(type_name, group):
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 512)).astype(np.float32) * np.exp(rng.standard_normal((24, 1)))
    w[3, :32] = 0.25  # a constant block (Q4_1 stores d = 0, m = 0.25; Q4_K / Q5_K a sub-block of scale 0)
    w[4, 32:64] = -0.5
    w[5, :256] = 0.0  # an all-zero super-block
    raw = quantize_k(w, type_name) if type_name.endswith("_K") else gguf.quants.quantize(w, qtype)
    tensors = decode_blocks(raw, type_name, 512, group)
    assert tensors["scales"].shape == tensors["qzeros"].shape == (24, 512 // group)
    ours = tensors["scales"].repeat_interleave(group, 1) * (tensors["qweight"].float() - tensors["qzeros"].repeat_interleave(group, 1))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert torch.allclose(ours, reference, rtol=1e-6, atol=1e-6 * float(reference.abs().max()))
    assert float((reference - torch.from_numpy(w)).abs().max()) < 0.2 * float(np.abs(w).max())  # a real quantization of w


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_layer_equals_gguf_dequantized_matmul(type_name, tmp_path, monkeypatch):
    """The grouped kernel on the decoded blocks equals x @ W^T with W = gguf's dequantize
    (float32 activations: the int8 ones are checked in tests/kernels)."""
    import gguf

    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")

    from pagedllm.model_executor.gguf_weights import KERNEL_TYPES
    from pagedllm.model_executor.layers.quantization.grouped import apply_grouped, store_grouped

    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 512)).astype(np.float32)
    raw = quantize_k(w, type_name)
    bits, group = KERNEL_TYPES[type_name]
    tensors = decode_blocks(raw, type_name, 512, group)
    layer = torch.nn.Module()
    layer.output_size_per_partition, layer.input_size_per_partition = 40, 512
    store_grouped(layer, tensors["qweight"], tensors["scales"], tensors["qzeros"], bits)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))
    for rows in (1, 3, 64):  # the streaming (decode) and dequantizing-GEMM paths
        x = torch.from_numpy(rng.standard_normal((rows, 512)).astype(np.float32))
        expected = x @ reference.T
        assert torch.allclose(apply_grouped(layer, x, None), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_unpermute_inverts_llama_cpp_permutation():
    rows = torch.arange(4 * 8 * 3).reshape(32, 3)
    assert torch.equal(unpermute_rows(permute_rows(rows, 4), 4), rows)
    assert not torch.equal(permute_rows(rows, 4), rows)


def test_gguf_without_tokenizer_metadata_asks_for_one(llama_128, tmp_path):
    path = write_gguf(llama_128, tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="Cannot load a tokenizer from .*model.gguf"):
        LLM(str(path), kv_cache_memory_bytes=8 << 20)


def test_dequantized_tensors_are_named_in_a_warning(llama_256, tmp_path, caplog):
    path = write_gguf(llama_256, tmp_path / "model-TQ2_0.gguf", "TQ2_0", "Q8_0")  # 14 linear, 5 norms, embeddings, lm_head
    with caplog.at_level("WARNING"):
        LLM(str(path), tokenizer=str(llama_256), dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert "model-TQ2_0.gguf: 21 quantized tensors dequantized at load to the model dtype" in caplog.text
    assert ("lm_head.weight (Q8_0), model.embed_tokens.weight (Q8_0), model.layers.0.input_layernorm.weight (Q8_0), "
            "model.layers.0.mlp.down_proj.weight (TQ2_0)") in caplog.text
