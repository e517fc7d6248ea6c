"""Content hashes of multimodal items (vLLM's ``MultiModalHasher``): equal items, and only
those, share a hash, which keys the encoder cache and enters the prefix-cache block hashes."""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch


def hash_item(data: Mapping[str, torch.Tensor]) -> str:
    """The SHA-256 (hex) of one item's processed tensors: each name, dtype, shape and bytes,
    by name order. The processor's output is a function of the image's pixels and the
    processor options, so two requests with the same image and options share it, and a
    different image (or a resize option that changes the pixels) does not."""
    digest = hashlib.sha256()
    for name in sorted(data):
        tensor = data[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
