"""Fixtures for LoRA tests: PEFT adapters made with ``peft`` on the tiny random-weight
checkpoints (random non-zero B), and the ``merge_and_unload()`` transformers checkpoint of
each, the reference their outputs must match."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import make_peft_adapter

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
