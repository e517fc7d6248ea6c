"""Writing a 16/32-bit Hugging Face checkpoint as a compressed-tensors 8-bit checkpoint (the
``int-quantized`` / ``float-quantized`` formats llm-compressor writes for its W8A8, FP8 and
FP8_DYNAMIC presets), with the compressed-tensors library's own pieces: its
``QuantizationArgs`` / ``QuantizationScheme`` / ``QuantizationConfig``, its
``calculate_qparams`` for every scale, and its ``IntQuantizationCompressor`` /
``FloatQuantizationCompressor`` for the stored tensors. Static input scales are calibrated
by running the float model (transformers) on ``calibration`` token ids and taking each
linear module's largest |input|, as llm-compressor's min-max observer does over its
calibration set. The ``lm_head`` stays unquantized.

    from pagedllm.testing.compressed_tensors_writer import write_w8a8
    write_w8a8(checkpoint_dir, out_dir, weight_type="int", weight_strategy="channel", activations="token")
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

#: The linear modules quantized (Llama / Qwen layouts).
_LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                    "gate_proj.weight", "up_proj.weight", "down_proj.weight")  # fmt: skip


def _input_amax(checkpoint: Path, calibration: list[list[int]]) -> dict[str, float]:
    """Checkpoint module name -> the largest |input| its forward saw on ``calibration``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and f"{name}.weight".endswith(_LINEAR_SUFFIXES):
            def hook(_module, inputs, name=name):
                amax[name] = max(amax.get(name, 0.0), float(inputs[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.inference_mode():
        for ids in calibration:
            model(torch.tensor([ids]))
    for handle in hooks:
        handle.remove()
    return amax


def write_w8a8(
    checkpoint: Path,
    out: Path,
    weight_type: str,
    weight_strategy: str,
    activations: Optional[str],
    calibration: Optional[list[list[int]]] = None,
) -> Path:
    """Write ``checkpoint`` quantized to ``out`` (see the module docstring) and return ``out``.

    Args:
        weight_type: "int" (int8, format int-quantized) or "float" (float8 e4m3, float-quantized).
        weight_strategy: "channel" or "tensor" (one weight scale per output row / per tensor).
        activations: "token" (dynamic per-token), "static" (per-tensor ``input_scale``
            calibrated on ``calibration``), or None (weight-only, format naive-quantized).
        calibration: token-id prompts for static scales.

    Raises:
        ValueError: static activations without ``calibration``.
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    weight_args = QuantizationArgs(num_bits=8, type=weight_type, symmetric=True, strategy=weight_strategy)
    input_args = None
    if activations is not None:
        input_args = QuantizationArgs(num_bits=8, type=weight_type, symmetric=True,
                                      strategy="token" if activations == "token" else "tensor",
                                      dynamic=activations == "token")  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=weight_args, input_activations=input_args)
    fmt = "naive-quantized" if input_args is None else f"{weight_type}-quantized"
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                                quantization_status="compressed").model_dump(exclude_none=True)  # fmt: skip
    compressor = BaseCompressor.get_value_from_registry(fmt)
    if activations == "static" and not calibration:
        raise ValueError("Static activation scales need calibration prompts.")
    amax = _input_amax(checkpoint, calibration) if activations == "static" else {}
    shutil.copytree(checkpoint, out)
    for path in sorted(checkpoint.glob("*.safetensors")):
        tensors = load_file(path)
        for name in [name for name in tensors if name.endswith(_LINEAR_SUFFIXES)]:
            module = name.removesuffix(".weight")
            w = tensors.pop(name).float()
            if weight_strategy == "tensor":
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            else:
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            scale, zero_point = calculate_qparams(lo, hi, weight_args)
            state = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
            if module in amax:
                bound = torch.tensor([amax[module]])
                state["input_scale"] = calculate_qparams(-bound, bound, input_args)[0]
            tensors.update({f"{module}.{key}": value.contiguous() for key, value in state.items()})
        save_file(tensors, out / path.name, metadata={"format": "pt"})
    hf_config = json.loads((out / "config.json").read_text())
    hf_config["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(hf_config))
    return out
