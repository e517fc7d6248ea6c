"""Random PEFT LoRA adapters for a checkpoint, written without ``peft`` (for ``pagedllm bench
throughput --enable-lora --lora-path``, and tests): ``adapter_config.json`` +
``adapter_model.safetensors`` in PEFT's format.

    python -m pagedllm.benchmarks.lora_adapters MODEL OUT_DIR [--rank 16] [--targets q_proj,...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from pagedllm.lora.peft_config import TARGET_PARENTS, module_shapes

ALL_TARGETS = tuple(TARGET_PARENTS)


def write_adapter(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``config`` as ``adapter_config.json`` (with PEFT's defaults for missing keys)
    and ``tensors`` as ``adapter_model.safetensors`` into ``out_dir``; returns ``out_dir``."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    full = {"peft_type": "LORA", "bias": "none", "lora_alpha": 16, "use_rslora": False, **config}
    (out_dir / "adapter_config.json").write_text(json.dumps(full, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))
    return out_dir


def make_random_adapter(
    model_path: str, out_dir: Path, rank: int = 16, targets: Sequence[str] = ALL_TARGETS, seed: int = 0,
    lora_alpha: Optional[float] = None,
) -> Path:
    """A rank-``rank`` adapter on ``targets`` of every layer of the checkpoint at
    ``model_path``, A and B drawn from N(0, 1/in) and N(0, 1/r) scaled small (float32).

    Raises:
        ValueError: a target not among ``ALL_TARGETS``.
    """
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path)
    shapes = module_shapes(hf_config)
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"unknown target modules {unknown}; choose among {list(ALL_TARGETS)}")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for target in targets:
            in_features, out_features = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{TARGET_PARENTS[target]}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    config = {"r": rank, "lora_alpha": lora_alpha or 2 * rank, "target_modules": list(targets),
              "base_model_name_or_path": str(model_path)}
    return write_adapter(out_dir, config, tensors)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Write a random PEFT LoRA adapter for a checkpoint.")
    parser.add_argument("model", help="checkpoint folder (config.json)")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(ALL_TARGETS), help="comma-separated target modules")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_random_adapter(args.model, args.out_dir, args.rank, args.targets.split(","), args.seed)
    print(out)


if __name__ == "__main__":
    main()
