"""Fixtures for LoRA tests: PEFT adapters made with ``peft`` on the tiny random-weight
checkpoints (random non-zero B), and the ``merge_and_unload()`` transformers checkpoint of
each, the reference their outputs must match."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def make_peft_adapter(base: Path, out_dir: Path, *, r: int, lora_alpha: float, target_modules: list[str],
                      use_rslora: bool = False, seed: int = 0, safe_serialization: bool = True) -> tuple[Path, Path]:
    """Write a PEFT LoRA adapter for ``base`` (A and B drawn at random, so it changes the
    outputs) and its merged model; returns (adapter folder, merged checkpoint folder)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, use_rslora=use_rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.5 / param.shape[1] ** 0.5))
    adapter_dir, merged_dir = out_dir / "adapter", out_dir / "merged"
    peft_model.save_pretrained(adapter_dir, safe_serialization=safe_serialization)
    peft_model.merge_and_unload().save_pretrained(merged_dir)
    return adapter_dir, merged_dir


#: name -> (r, lora_alpha, target modules, use_rslora, safetensors?)
ADAPTERS = {
    "attn_r4": (4, 8, ["q_proj", "v_proj"], False, True),
    "all_r8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False, True),
    "mlp_r16_rslora": (16, 4, ["gate_proj", "up_proj", "down_proj"], True, True),
    "ko_r2_bin": (2, 2, ["k_proj", "o_proj", "up_proj"], False, False),
}


@pytest.fixture(scope="session")
def peft_adapters(tiny_llama, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (adapter folder, merged checkpoint) for each of ``ADAPTERS`` on ``tiny_llama``."""
    out = {}
    for seed, (name, (r, alpha, targets, rslora, safe)) in enumerate(ADAPTERS.items()):
        out[name] = make_peft_adapter(tiny_llama, tmp_path_factory.mktemp(f"lora-{name}"), r=r, lora_alpha=alpha,
                                      target_modules=targets, use_rslora=rslora, seed=seed, safe_serialization=safe)
    return out
