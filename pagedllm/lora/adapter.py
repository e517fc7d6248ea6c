"""Load a PEFT LoRA adapter's tensors (checked by ``peft_config.check_adapter``) into
per-module (A, scaling * B) pairs on the CPU, ready to be copied into device slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.lora.peft_config import TARGET_PARENTS, check_adapter, parse_weight_name
from pagedllm.lora.request import LoRARequest, adapter_weight_file


@dataclass
class LoRAAdapter:
    """One loaded adapter.

    ``modules``: the language model's module name (``model.layers.0.self_attn.q_proj``, also
    for an image-text model's adapter) -> (A [r, in],
    scaling * B [out, r]), float32 CPU tensors. ``rank``: r (the config's).
    """

    key: tuple[str, int, int]
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(request: LoRARequest, hf_config: Any, max_lora_rank: int) -> LoRAAdapter:
    """Read ``request.lora_path`` and fold the scaling into B.

    Raises:
        FileNotFoundError, ValueError: see ``check_adapter``; also a module with A but no B
            (or B but no A).
    """
    config = check_adapter(request.lora_path, hf_config, max_lora_rank)
    weight_file = adapter_weight_file(request.lora_path)
    if weight_file.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(weight_file))
    else:
        tensors = torch.load(weight_file, map_location="cpu", weights_only=True)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        layer, target, ab = parse_weight_name(name, request.lora_path)
        module = f"model.layers.{layer}.{TARGET_PARENTS[target]}.{target}"  # the language model's name
        halves.setdefault(module, {})[ab] = tensor.float()
    modules = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {request.lora_path!r}: {module} has lora_{''.join(pair)} but not both A and B.")
        modules[module] = (pair["A"], pair["B"] * config.scaling)
    return LoRAAdapter(key=request.adapter_key, rank=config.r, modules=modules)
