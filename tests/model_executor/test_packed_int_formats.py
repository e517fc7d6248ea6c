"""GPTQ, AWQ and compressed-tensors (pack-quantized) checkpoints load and run: each linear
layer's packed integers, scales and zero points become the int4 / int8 kernels' weights, and
the engine's greedy output equals transformers' on the same model with every linear weight
replaced by its dequantized value.

The GPTQ and AWQ checkpoints are written here in the exact tensor layouts of AutoGPTQ's and
AutoAWQ's packers (GPTQ: inputs packed, zeros stored minus one in the original format; AWQ:
outputs packed in the interleaved order 0 2 4 6 1 3 5 7); the compressed-tensors ones by the
compressed-tensors library itself, whose ``decompress`` gives the reference weights. Bad
checkpoints fail at load naming the layer, the tensor and what is supported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM
from pagedllm.model_executor.layers.quantization.awq import AWQ_ORDER
from pagedllm.model_executor.layers.quantization.grouped import INT8_ACTIVATIONS_ENV
from pagedllm.model_executor.layers.quantization.packed_int import unpack_int32
from tests.helpers import LINEAR_SUFFIXES, assert_greedy_equals_hf, model_runner

def _pack(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[rows, cols] unsigned values -> [rows, cols * bits / 32] int32, value i of each word at
    bits [i * bits, ...) taken from column ``order[i]`` of the word's run."""
    per_word = 32 // bits
    v = values.numpy().astype(np.uint32).reshape(values.shape[0], -1, per_word)
    order = order or list(range(per_word))
    words = np.zeros(v.shape[:2], dtype=np.uint32)
    for i, column in enumerate(order):
        words |= v[:, :, column] << np.uint32(i * bits)
    return torch.from_numpy(words.view(np.int32))


def _quantize(w: torch.Tensor, bits: int, group: int, sym: bool, gen: torch.Generator, min_zero: int = 0):
    """W [N, K] -> (Q [N, K] unsigned, scale [N, G] float16-exact, zero [N, G] unsigned, at
    least ``min_zero``) with W ~ scale * (Q - zero) per group of ``group`` inputs (-1: per row)."""
    n, k = w.shape
    group = k if group == -1 else group
    wg = w.view(n, k // group, group)
    top = 2**bits - 1
    if sym:
        scale = wg.abs().amax(-1) / (top // 2)
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = (hi - lo) / top
        zero = torch.randint(min_zero, top + 1, scale.shape, generator=gen).float()  # any zero point
    scale = scale.half().float()
    q = torch.round(wg / scale[..., None] + zero[..., None]).clamp(0, top)
    return q.view(n, k).to(torch.uint8), scale, zero


def _dequantized(q, scale, zero) -> torch.Tensor:
    group = q.shape[1] // scale.shape[1]
    return scale.repeat_interleave(group, 1) * (q.float() - zero.repeat_interleave(group, 1))


def _write(src: Path, out: Path, ref: Path, quant_config: dict, convert,
           suffixes: tuple[str, ...] = LINEAR_SUFFIXES) -> tuple[Path, Path]:
    """The quantized checkpoint (``convert(module, W) -> (tensors, dequantized W)`` for each
    weight whose name ends with one of ``suffixes``) in ``out``, and in ``ref`` the reference
    checkpoint with the dequantized weights."""
    shutil.copytree(src, out)
    shutil.copytree(src, ref)
    for path in sorted(src.glob("*.safetensors")):
        tensors, reference = load_file(path), load_file(path)
        for name in [name for name in tensors if name.endswith(suffixes)]:
            module = name.removesuffix(".weight")
            packed, dequantized = convert(module, tensors.pop(name).float())
            tensors.update({f"{module}.{key}": value.contiguous() for key, value in packed.items()})
            reference[name] = dequantized.to(reference[name].dtype)
        save_file(tensors, out / path.name, metadata={"format": "pt"})
        save_file(reference, ref / path.name, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config))
    return out, ref


def gptq(bits: int, group: int, desc_act: bool, sym: bool, checkpoint_format: str = "gptq"):
    gen = torch.Generator().manual_seed(bits * 100 + group)
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": checkpoint_format}  # fmt: skip

    perms: dict[str, torch.Tensor] = {}

    def convert(module: str, w: torch.Tensor):
        n, k = w.shape
        # Act-order sorts inputs by the Hessian's diagonal, which modules of one input share.
        shared_input = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        perm = perms.setdefault(shared_input, torch.randperm(k, generator=gen) if desc_act else torch.arange(k))
        # Groups over permuted inputs. The original format stores zero - 1, so it cannot hold a
        # zero point of 0 (the reason for gptq_v2): its writers never produce one.
        q, scale, zero = _quantize(w[:, perm], bits, group, sym, gen, min_zero=int(checkpoint_format == "gptq"))
        inverse = perm.argsort()
        g_idx = (inverse // (k if group == -1 else group)).to(torch.int32)
        stored_zero = zero - (1 if checkpoint_format == "gptq" else 0)
        tensors = {
            "qweight": _pack(q[:, inverse].contiguous(), bits).T,  # [K * bits / 32, N]
            "qzeros": _pack(stored_zero.T.to(torch.int64), bits),  # [G, N * bits / 32]
            "scales": scale.T.half(),
            "g_idx": g_idx,
        }
        return tensors, _dequantized(q, scale, zero)[:, inverse]

    return config, convert


def awq(group: int):
    gen = torch.Generator().manual_seed(group)
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}

    def convert(module: str, w: torch.Tensor):
        q, scale, zero = _quantize(w, 4, group, False, gen)
        tensors = {
            "qweight": _pack(q.T.contiguous(), 4, AWQ_ORDER),  # [K, N / 8]
            "qzeros": _pack(zero.T.to(torch.int64), 4, AWQ_ORDER),  # [G, N / 8]
            "scales": scale.T.half(),
        }
        return tensors, _dequantized(q, scale, zero)

    return config, convert


def compressed_tensors(bits: int, strategy: str, sym: bool, group: int = 32):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=group if strategy == "group" else None)  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"],
                                quantization_status="compressed").model_dump(exclude_none=True)  # fmt: skip

    def convert(module: str, w: torch.Tensor):
        n, k = w.shape
        wg = w.view(n, -1, group if strategy == "group" else k)
        scale, zero_point = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
        tensors = PackedQuantizationCompressor.compress(state, scheme)
        return tensors, PackedQuantizationCompressor.decompress(tensors, scheme)["weight"]

    return config, convert


#: name -> (checkpoint writer, the dtype of the linear layers' weights once loaded: uint8 =
#: linear_w4 / linear_w8g (grouped), int8 = linear_w8 (symmetric, per channel)).
FORMATS = {
    "gptq-4bit-g32-sym": (lambda: gptq(4, 32, desc_act=False, sym=True), torch.uint8),
    "gptq-4bit-g32-act-order-asym": (lambda: gptq(4, 32, desc_act=True, sym=False), torch.uint8),
    "gptq_v2-4bit-g128": (lambda: gptq(4, 128, desc_act=False, sym=False, checkpoint_format="gptq_v2"), torch.uint8),
    "gptq-8bit-channel-sym": (lambda: gptq(8, -1, desc_act=False, sym=True), torch.int8),
    "gptq-8bit-g64-asym": (lambda: gptq(8, 64, desc_act=False, sym=False), torch.uint8),
    "awq-4bit-g32": (lambda: awq(32), torch.uint8),
    "awq-4bit-g128": (lambda: awq(128), torch.uint8),
    "compressed-tensors-w4a16-g32-asym": (lambda: compressed_tensors(4, "group", sym=False), torch.uint8),
    "compressed-tensors-w4a16-g128-sym": (lambda: compressed_tensors(4, "group", sym=True, group=128), torch.uint8),
    "compressed-tensors-w8a16-channel-sym": (lambda: compressed_tensors(8, "channel", sym=True), torch.int8),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_greedy_equals_hf_on_dequantized_weights(fmt, llama_128, tmp_path, monkeypatch):
    # transformers multiplies float32 activations: so do we here (int8 activations: test_gguf.py).
    monkeypatch.setenv(INT8_ACTIVATIONS_ENV, "0")
    writer, weight_dtype = FORMATS[fmt]
    config, convert = writer()
    quantized, reference = _write(llama_128, tmp_path / "quantized", tmp_path / "reference", config, convert)
    llm = LLM(str(quantized), dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert_greedy_equals_hf(llm, reference)
    model = model_runner(llm).model
    layers = [m for m in model.modules() if hasattr(m, "input_perm")]
    assert len(layers) == 4 * model_runner(llm).model_config.num_layers  # qkv, o, gate_up, down
    assert {m.weight.dtype for m in layers} == {weight_dtype}
    assert model.lm_head.weight.dtype == torch.float32


def test_unpack_int32_matches_compressed_tensors_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    torch.manual_seed(0)
    for bits in (4, 8):
        signed = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (24, 64), dtype=torch.int8)
        unsigned = (signed.to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)
        assert torch.equal(unpack_int32(pack_to_int32(signed, bits), bits, dim=1), unsigned)
        assert torch.equal(unpack_int32(pack_to_int32(signed, bits, packed_dim=0), bits, dim=0), unsigned)


def _gptq_checkpoint(llama_128, tmp_path, **overrides) -> Path:
    config, convert = gptq(4, 32, desc_act=False, sym=True)
    quantized, _ = _write(llama_128, tmp_path / "q", tmp_path / "r", config, convert)
    config_path = quantized / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"].update(overrides)
    config_path.write_text(json.dumps(config))
    return quantized


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"quant_method": "bitsandbytes"}, r"Quantization method 'bitsandbytes' is not supported yet. Supported: awq, compressed-tensors, fp8, gguf, gptq, int4, int8, mxfp4, unquantized"),
        ({"bits": 3}, r"gptq: 3-bit weights are not supported; supported: \(4, 8\)"),
        ({"group_size": 48}, r"gptq: group_size 48 is not supported; supported: \(-1, 32, 64, 128\)"),
        ({"group_size": 64}, r"gptq: layer model\.layers\.0\.\S+( \(part '\w+'\))?, tensor '\w+': Checkpoint tensor shape .*Expected 4-bit weights in groups of 64"),
    ],
)
def test_bad_checkpoints_fail_at_load_named(llama_128, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(_gptq_checkpoint(llama_128, tmp_path, **overrides)), kv_cache_memory_bytes=8 << 20)


def test_fused_parts_with_different_act_order_are_refused(llama_128, tmp_path):
    quantized = _gptq_checkpoint(llama_128, tmp_path)
    path = next(quantized.glob("*.safetensors"))
    tensors = load_file(path)
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"qkv_proj \(part '[qkv]'\), tensor 'g_idx': the act-order groups differ"):
        LLM(str(quantized), kv_cache_memory_bytes=8 << 20)


def test_activation_quantized_compressed_tensors_scheme_is_refused(llama_128, tmp_path):
    config, convert = compressed_tensors(4, "group", sym=True)
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    quantized, _ = _write(llama_128, tmp_path / "q", tmp_path / "r", config, convert)
    with pytest.raises(ValueError, match=r"config group 'group_0' quantizes activations; supported: weight-only int schemes"):
        LLM(str(quantized), kv_cache_memory_bytes=8 << 20)
