"""FP8 weights: ``--quantization fp8`` (per-tensor e4m3, at load) and ``quant_method: "fp8"``
checkpoints (per-tensor ``weight_scale`` per module, fused parts each with their own; an unused
``input_scale``; block-wise ``weight_scale_inv``, dequantized at load). The engine's greedy
output equals transformers' on the same model with every linear weight replaced by its
dequantized value."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM
from pagedllm.model_executor.layers.quantization.fp8 import quantize_fp8_per_tensor
from tests.helpers import LINEAR_SUFFIXES, assert_greedy_equals_hf, model_runner, rewrite_linear_weights

def _fp8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    f8, scale = quantize_fp8_per_tensor(weight)
    return f8.float() * scale


def _linear_layers(llm: LLM):
    return [m for name, m in model_runner(llm).model.named_modules() if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]


def test_quantize_per_tensor():
    w = torch.randn(8, 16)
    f8, scale = quantize_fp8_per_tensor(w)
    assert f8.dtype == torch.float8_e4m3fn and float(f8.float().abs().max()) == 448.0
    assert torch.allclose(f8.float() * scale, w, rtol=2**-3, atol=0)  # 3 mantissa bits
    assert float(quantize_fp8_per_tensor(torch.zeros(2, 2))[1]) == 1.0


def test_online_fp8_greedy_equals_hf_on_dequantized_weights(llama_128, tmp_path):
    reference = rewrite_linear_weights(llama_128, tmp_path / "fp8-dequantized", _fp8_round_trip)
    llm = LLM(str(llama_128), dtype="float32", quantization="fp8", kv_cache_memory_bytes=8 << 20)
    assert_greedy_equals_hf(llm, reference)
    assert {m.weight.dtype for m in _linear_layers(llm)} == {torch.float8_e4m3fn}
    assert model_runner(llm).model.lm_head.weight.dtype == torch.float32


def _write_fp8_checkpoint(src: Path, out: Path, ref: Path, block: list[int] | None,
                          suffixes: tuple[str, ...] = LINEAR_SUFFIXES) -> None:
    """``src`` as an FP8 checkpoint in ``out`` (each weight whose name ends with one of
    ``suffixes``), and in ``ref`` with those weights dequantized."""
    shutil.copytree(src, out)
    shutil.copytree(src, ref)
    gen = torch.Generator().manual_seed(0)
    for path in sorted(src.glob("*.safetensors")):
        tensors, reference = load_file(path), load_file(path)
        for name in [n for n in tensors if n.endswith(suffixes)]:
            module, w = name.removesuffix(".weight"), tensors[name].float()
            if block is None:
                f8, scale = quantize_fp8_per_tensor(w)
                tensors[f"{module}.weight_scale"] = scale.reshape(())
                dequantized = f8.float() * scale
            else:  # one scale per block, drawn at random (any positive scale is valid)
                rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
                scale = torch.rand(rows, cols, generator=gen) * 0.01 + 0.001
                full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
                f8 = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
                tensors[f"{module}.weight_scale_inv"] = scale
                dequantized = f8.float() * full
            tensors[name] = f8
            tensors[f"{module}.input_scale"] = torch.tensor(0.5)
            reference[name] = dequantized
        save_file(tensors, out / path.name, metadata={"format": "pt"})
        save_file(reference, ref / path.name, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                     **({"weight_block_size": block} if block else {})}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("block,weight_dtype", [(None, torch.float8_e4m3fn), ([64, 64], torch.float32)])
def test_fp8_checkpoint_greedy_equals_hf_on_dequantized_weights(llama_128, tmp_path, block, weight_dtype):
    _write_fp8_checkpoint(llama_128, tmp_path / "fp8", tmp_path / "reference", block)
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert_greedy_equals_hf(llm, tmp_path / "reference")
    assert {m.weight.dtype for m in _linear_layers(llm)} == {weight_dtype}


def test_per_channel_scales_are_refused_naming_the_tensor(llama_128, tmp_path):
    _write_fp8_checkpoint(llama_128, tmp_path / "fp8", tmp_path / "reference", None)
    path = next((tmp_path / "fp8").glob("*.safetensors"))
    tensors = load_file(path)
    name = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name].reshape(1).expand(128).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"fp8: layer model\.layers\.0\.mlp\.down_proj, tensor 'weight_scale': expected one scale per tensor"):
        LLM(str(tmp_path / "fp8"), kv_cache_memory_bytes=8 << 20)
