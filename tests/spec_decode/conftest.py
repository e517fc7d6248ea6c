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


@pytest.fixture(scope="session")
def llama_eagle_heads(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """Random EAGLE (with fc.bias) and EAGLE-3 (half the vocabulary, layers 0, 1, 1) heads
    for ``tiny_llama``: their drafts are almost never accepted."""
    from tests.fixtures.eagle_heads import make_eagle_head

    out = tmp_path_factory.mktemp("eagle")
    return {"eagle": make_eagle_head(out / "eagle", tiny_llama, "eagle", fc_bias=True, seed=1),
            "eagle3": make_eagle_head(out / "eagle3", tiny_llama, "eagle3", aux_layer_ids=[0, 1, 1], seed=2)}


@pytest.fixture(scope="session")
def bigram_target(tmp_path_factory) -> Path:
    from tests.fixtures.eagle_heads import make_bigram_target

    return make_bigram_target(tmp_path_factory.mktemp("bigram") / "target", seed=3)


@pytest.fixture(scope="session")
def exact_eagle_heads(bigram_target, tmp_path_factory) -> dict[str, Path]:
    """EAGLE and EAGLE-3 heads that reproduce ``bigram_target``'s next token exactly."""
    from tests.fixtures.eagle_heads import make_exact_eagle_head

    out = tmp_path_factory.mktemp("exact-eagle")
    return {method: make_exact_eagle_head(out / method, bigram_target, method) for method in ("eagle", "eagle3")}
