"""Draft checkpoints for the speculative-decoding tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file


def noisy_copy(source: Path, out: Path, relative_noise: float, seed: int = 0) -> Path:
    """A copy of checkpoint ``source`` with Gaussian noise of ``relative_noise`` x each
    tensor's standard deviation added to its weights: a draft that agrees with the target
    often but not always."""
    shutil.copytree(source, out)
    generator = torch.Generator().manual_seed(seed)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if tensor.numel() > 1 and "norm" not in name:
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
                tensors[name] = (tensor.float() + relative_noise * tensor.float().std() * noise).to(tensor.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def noisy_llama_draft(tiny_llama, tmp_path_factory) -> Path:
    """``tiny_llama`` with noise: about 40% of its greedy drafts are the target's tokens."""
    return noisy_copy(tiny_llama, tmp_path_factory.mktemp("draft") / "noisy-llama", relative_noise=0.08)
