"""Device-specific facts behind one interface: which device, its memory, its preferred dtype.

Everything else in pagedllm asks ``current_platform`` instead of testing for CUDA itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch


@dataclass(frozen=True)
class Platform:
    """The device pagedllm runs on.

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"``.
    """

    device_type: str

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def total_memory_bytes(self) -> int:
        """Device memory in bytes: the GPU's total, or on CPU the RAM available now."""
        if self.is_cuda:
            return torch.cuda.get_device_properties(0).total_memory
        return psutil.virtual_memory().available

    def half_dtype(self) -> torch.dtype:
        """The 16-bit dtype to use when a float32 checkpoint is loaded with dtype "auto"."""
        return torch.bfloat16

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()


current_platform = Platform("cuda" if torch.cuda.is_available() else "cpu")
