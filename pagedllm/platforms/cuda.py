"""``CudaPlatform``: one NVIDIA GPU; memory measured by the CUDA caching allocator."""

from __future__ import annotations

from typing import Callable

import torch

from pagedllm.platforms.interface import Platform


class CudaPlatform(Platform):
    """An NVIDIA GPU (device 0); attention by portable PyTorch until a CUDA backend registers."""

    device_type = "cuda"
    attn_backend_preference = ("TORCH_SDPA",)

    def total_memory_bytes(self) -> int:
        """The GPU's total memory, in bytes."""
        return torch.cuda.get_device_properties(0).total_memory

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def profile_activation_peak(self, dummy_run: Callable[[int], None], max_num_tokens: int) -> int:
        """``torch.cuda.max_memory_allocated`` growth over a full-size dummy run."""
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        dummy_run(max_num_tokens)
        return torch.cuda.max_memory_allocated() - base
