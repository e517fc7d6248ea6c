"""FP8 KV-cache scales in a checkpoint: which tensors they are, and loading them into the
``Attention`` layers' ``k_scale`` / ``v_scale`` buffers.

The names vLLM reads (``maybe_remap_kv_scale_name``, and ``get_cache_scale`` of the FP8 and
compressed-tensors formats), for the attention module ``PREFIX.self_attn``:

- ``PREFIX.self_attn.k_scale`` / ``.v_scale`` (llm-compressor, FP8 checkpoints);
- ``PREFIX.self_attn.k_proj.k_scale`` / ``.v_proj.v_scale`` (NVIDIA ModelOpt);
- ``PREFIX.self_attn.k_proj.output_scale`` / ``.v_proj.output_scale`` (compressed-tensors'
  ``kv_cache_scheme``);
- ``PREFIX.self_attn.kv_scale``: one scale for both (a deprecated format).

Each is one per-tensor float: the dequantization scale, stored FP8 x scale = the value.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

_PATTERNS = (
    (re.compile(r"(.*\.self_attn)\.([kv])_scale$"), None),
    (re.compile(r"(.*\.self_attn)\.([kv])_proj\.\2_scale$"), None),
    (re.compile(r"(.*\.self_attn)\.([kv])_proj\.output_scale$"), None),
    (re.compile(r"(.*\.self_attn)\.kv_scale$"), ("k", "v")),
)


def kv_scale_targets(name: str) -> Optional[tuple[str, ...]]:
    """The ``Attention`` buffers (``PREFIX.self_attn.attn.k_scale`` / ``.v_scale``) that the
    checkpoint tensor ``name`` sets; None if it is not a KV-cache scale."""
    for pattern, both in _PATTERNS:
        match = pattern.fullmatch(name)
        if match:
            kinds = both or (match.group(2),)
            return tuple(f"{match.group(1)}.attn.{kind}_scale" for kind in kinds)
    return None


def load_kv_cache_scale(buffers: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> bool:
    """Copy ``tensor`` into the buffers it names if ``name`` is a KV-cache scale; whether it was.

    Raises:
        ValueError: a scale with more than one element (only per-tensor scales exist for the
            FP8 KV cache, as in vLLM), or one whose attention layer the model lacks.
    """
    targets = kv_scale_targets(name)
    if targets is None:
        return False
    if tensor.numel() != 1:
        raise ValueError(
            f"Checkpoint tensor {name!r} has shape {list(tensor.shape)}; an FP8 KV-cache scale must be one "
            f"per-tensor value (per-head or per-channel KV scales are not supported)."
        )
    for target in targets:
        buffer = buffers.get(target)
        if buffer is None:
            raise ValueError(f"Checkpoint tensor {name!r} is a KV-cache scale, but the model has no {target!r}.")
        buffer.fill_(float(tensor.reshape(()).float()))
    return True
