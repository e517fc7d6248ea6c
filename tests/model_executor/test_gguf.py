"""GGUF files load and run: ``LLM("model.gguf", tokenizer=HF_DIR)`` reads the architecture and
hyper-parameters from the file's metadata, maps GGUF tensor names back to Hugging Face's
(Llama's q / k rows un-permuted), runs Q4_0 / Q4_1 / Q8_0 linear weights on the grouped
integer kernels and dequantizes other types at load; greedy output equals transformers' own GGUF loading
(which dequantizes everything) on the same file. The files are written by
``pagedllm.testing.gguf_writer`` with the ``gguf`` package's writer and quantizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.gguf_weights import decode_blocks, unpermute_rows
from pagedllm.testing.gguf_writer import permute_rows, write_gguf
from tests.helpers import model_runner, random_prompts

PROMPTS = random_prompts([5, 17, 40], 1000, seed=3)


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


@pytest.mark.parametrize(
    "model,linear_type,other_type,weight_dtype",
    [
        ("llama_128", "Q4_0", "F32", torch.uint8),
        ("llama_128", "Q4_1", "F16", torch.uint8),
        ("llama_128", "Q8_0", "F32", torch.uint8),
        ("llama_128", "Q5_0", "F32", torch.float32),  # no Q5_0 kernel: dequantized at load
        ("qwen2_128", "Q4_0", "F32", torch.uint8),
    ],
)
def test_greedy_equals_transformers_gguf(request, tmp_path, model, linear_type, other_type, weight_dtype):
    checkpoint = request.getfixturevalue(model)
    path = write_gguf(checkpoint, tmp_path / f"model-{linear_type}.gguf", linear_type, other_type)
    llm = LLM(str(path), tokenizer=str(checkpoint), dtype="float32", kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert list(output.outputs[0].token_ids) == _hf_gguf_greedy(path, prompt, 8)
    runner = model_runner(llm)
    layers = [m for name, m in runner.model.named_modules() if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
    assert {m.weight.dtype for m in layers} == {weight_dtype}
    assert runner.model_config.hf_config.num_hidden_layers == 2 and runner.model_config.architecture.endswith("ForCausalLM")


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_decoded_blocks_equal_gguf_dequantize(type_name):
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    w[3, :32] = 0.25  # a constant block (Q4_1 stores d = 0, m = 0.25)
    raw = gguf.quants.quantize(w, qtype)
    tensors = decode_blocks(raw, type_name, 96)
    group = tensors["scales"].repeat_interleave(32, 1)
    ours = group * (tensors["qweight"].float() - tensors["qzeros"].repeat_interleave(32, 1))
    assert torch.allclose(ours, torch.from_numpy(gguf.quants.dequantize(raw, qtype)), atol=1e-6)


def test_unpermute_inverts_llama_cpp_permutation():
    rows = torch.arange(4 * 8 * 3).reshape(32, 3)
    assert torch.equal(unpermute_rows(permute_rows(rows, 4), 4), rows)
    assert not torch.equal(permute_rows(rows, 4), rows)


def test_gguf_without_tokenizer_metadata_asks_for_one(llama_128, tmp_path):
    path = write_gguf(llama_128, tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="Cannot load a tokenizer from .*model.gguf"):
        LLM(str(path), kv_cache_memory_bytes=8 << 20)
