"""The platform pagedllm runs on, chosen once: ``current_platform`` (see ``interface``)."""

from __future__ import annotations

import torch

from pagedllm.platforms.interface import Platform


def _detect() -> Platform:
    if torch.cuda.is_available():
        from pagedllm.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from pagedllm.platforms.cpu import CpuPlatform

    return CpuPlatform()


current_platform: Platform = _detect()

__all__ = ["Platform", "current_platform"]
