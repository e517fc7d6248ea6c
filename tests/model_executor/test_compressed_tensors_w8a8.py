"""compressed-tensors' 8-bit schemes load and run: W8A8 int8 (``int-quantized``: int8 weights,
dynamic per-token or static per-tensor int8 activations) and FP8 (``float-quantized``: float8
weights per channel or per tensor, dynamic per-token or static per-tensor fp8 activations),
plus weight-only ``naive-quantized`` groups. Checkpoints are written by the compressed-tensors
library's own compressors (``tests.fixtures.compressed_tensors_writer``); greedy output equals
transformers' on the same checkpoint (its compressed-tensors integration runs these schemes on
CPU, decompressing the weights and fake-quantizing the activations; with quantized activations,
up to the first step float32 rounding can flip: ``assert_greedy_close_to_hf``), and a layer's output
equals the reference built from the library's ``decompress`` and its activation quantize op.
Unsupported schemes fail at load, named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedllm import LLM
from tests.fixtures.compressed_tensors_writer import write_w8a8
from tests.helpers import assert_greedy_close_to_hf, assert_greedy_equals_hf, model_runner, random_prompts

#: name -> (weight type, weight strategy, activations, the layers' weight dtype once loaded).
SCHEMES = {
    "w8a8-int8-channel-token": ("int", "channel", "token", torch.int8),
    "w8a8-int8-tensor-static": ("int", "tensor", "static", torch.int8),
    "fp8-dynamic-channel-token": ("float", "channel", "token", torch.float8_e4m3fn),
    "fp8-tensor-static": ("float", "tensor", "static", torch.float8_e4m3fn),
    "fp8-weight-only-channel": ("float", "channel", None, torch.float8_e4m3fn),
    "int8-weight-only-channel": ("int", "channel", None, torch.int8),
}

CALIBRATION = random_prompts([24, 40], 1000, seed=11)


def _write(llama_128: Path, tmp_path: Path, name: str) -> Path:
    weight_type, strategy, activations, _ = SCHEMES[name]
    return write_w8a8(llama_128, tmp_path / name, weight_type, strategy, activations, CALIBRATION)


def _layers(llm: LLM) -> dict[str, torch.nn.Module]:
    model = model_runner(llm).model
    return {name: m for name, m in model.named_modules() if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}


#: transformers 5.24 cannot run int8 weight-only naive-quantized checkpoints (its decompression
#: leaves the weight [1, in]: a shape error in the first matmul); the layer test covers them.
_HF_RUNS = sorted(set(SCHEMES) - {"int8-weight-only-channel"})


@pytest.mark.parametrize("name", _HF_RUNS)
def test_greedy_equals_transformers_on_the_same_checkpoint(name, llama_128, tmp_path):
    path = _write(llama_128, tmp_path, name)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20)
    (assert_greedy_equals_hf if SCHEMES[name][2] is None else assert_greedy_close_to_hf)(llm, path)
    layers = _layers(llm)
    assert len(layers) == 8 and {m.weight.dtype for m in layers.values()} == {SCHEMES[name][3]}
    assert model_runner(llm).model.lm_head.weight.dtype == torch.float32


def _reference_layer(path: Path, modules: list[str], x: torch.Tensor) -> torch.Tensor:
    """The library's answer for the fused layer of checkpoint ``modules``: each module's
    weights decompressed by its compressor, the input quantized and dequantized by its
    quantize op (dynamic scales from its ``compute_dynamic_scales_and_zp``)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    config = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    tensors = load_file(next(path.glob("*.safetensors")))
    outputs = []
    for module in modules:
        state = {key.removeprefix(f"{module}."): value for key, value in tensors.items() if key.startswith(f"{module}.")}
        weight = compressor.decompress(state, scheme)["weight"].float()
        inputs = x
        args = scheme.input_activations
        if args is not None:
            batch = x.unsqueeze(0)  # [batch, tokens, hidden], as the library's "token" strategy expects
            if args.dynamic:
                scale, zero_point = compute_dynamic_scales_and_zp(batch, args, module=None)
            else:
                scale, zero_point = state["input_scale"], None
            inputs = fake_quantize(batch, scale, zero_point, args)[0]
        outputs.append(inputs @ weight.T)
    return torch.cat(outputs, dim=-1)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_layer_outputs_equal_the_library_reference(name, llama_128, tmp_path):
    path = _write(llama_128, tmp_path, name)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20)
    layers = _layers(llm)
    gen = torch.Generator().manual_seed(0)
    prefix = "model.layers.1"
    cases = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "mlp.down_proj": ["down_proj"]}
    for layer_name, parts in cases.items():
        layer = layers[f"{prefix}.{layer_name}"]
        x = torch.randn(5, layer.input_size, generator=gen) * 3
        x[1] = 0.0  # an all-zero token
        head = layer_name.rpartition(".")[0]
        expected = _reference_layer(path, [f"{prefix}.{head}.{part}" for part in parts], x)
        with torch.inference_mode():
            got = layer(x.to(layer.weight_scale.device)).cpu()
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())), (got - expected).abs().max()


@pytest.mark.parametrize(
    "group,message",
    [
        ({"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
          "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}},
         r"config group 'group_0': weights strategy 'block' \(block-wise FP8\) is not supported; supported: 8-bit symmetric"),
        ({"weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
          "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": False, "dynamic": False}},
         r"config group 'group_0', input_activations: asymmetric \(input_zero_point\) is not supported"),
        ({"weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}},
         r"input_activations: 8-bit float with int weights is not supported"),
        ({"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}},
         r"config group 'group_0': 4-bit int weights is not supported"),
    ],
)
def test_unsupported_schemes_fail_at_load_named(group, message, llama_128, tmp_path):
    path = _write(llama_128, tmp_path, "w8a8-int8-channel-token")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"].update(group)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), kv_cache_memory_bytes=8 << 20)


def test_a_float_weight_where_int8_is_declared_fails_named(llama_128, tmp_path):
    path = _write(llama_128, tmp_path, "fp8-dynamic-channel-token")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["type"] = "int"
    (path / "config.json").write_text(json.dumps(config))
    message = r"compressed-tensors: layer model\.layers\.0\.\S+, tensor 'weight': expected torch\.int8, got torch\.float8_e4m3fn"
    with pytest.raises(ValueError, match=message):
        LLM(str(path), kv_cache_memory_bytes=8 << 20)
