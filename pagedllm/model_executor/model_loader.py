"""Build a model and load its weights from a Hugging Face directory (safetensors)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.models.registry import get_model_class

logger = logging.getLogger(__name__)


def safetensors_files(model_path: Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files: from ``model.safetensors.index.json`` when
    present (sharded), else every ``*.safetensors`` file in the directory.

    Raises:
        ValueError: if there are none.
    """
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_path / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"No *.safetensors files in {model_path}; pagedllm loads safetensors checkpoints only.")
    return files


def iterate_weights(model_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, one file at a time."""
    for path in safetensors_files(model_path):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def get_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """Instantiate the architecture named in config.json on ``device`` in ``model_config.dtype``
    and load the checkpoint into it.

    Raises:
        ValueError: unsupported architecture, missing files, unknown tensor names, shape
            mismatches, or parameters the checkpoint does not provide.
    """
    model_cls = get_model_class(model_config.architecture)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = model_cls(model_config.hf_config)
    finally:
        torch.set_default_dtype(old_dtype)
    loaded = model.load_weights(iterate_weights(model_config.model_path))
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"Checkpoint {model_config.model_path} lacks weights for: {sorted(missing)[:8]}")
    for module in model.modules():
        process = getattr(module, "process_weights_after_loading", None)
        if process is not None:
            process()
    paths = Counter(m.describe_path() for m in model.modules() if isinstance(m, Linear))
    logger.info(
        "Model dtype %s; linear layers: %s",
        str(model_config.dtype).removeprefix("torch."),
        ", ".join(f"{count} x {path}" for path, count in paths.items()),
    )
    return model.eval()
