"""Whether the state layers' decode ops, and the gated delta rule's prefill, run the C++ CPU
kernels (``pagedllm.kernels.cpu``): decided once, at the first call, from
``platforms.current_platform`` and the kernels' own availability, and again whenever the
kernels' build may change (``runtime.on_change``).

The kernels run on the CPU platform when they are built at a vector level (avx2 and up);
the portable build's scalar loops are no faster than PyTorch's vectorised ops there, so
PyTorch's code runs instead, as it does where the kernels are unavailable.
"""

from __future__ import annotations

from typing import Optional

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels.cpu import runtime
from pagedllm.platforms import current_platform

_decision: Optional[bool] = None


def _forget() -> None:
    global _decision
    _decision = None


runtime.on_change(_forget)


def use_kernels() -> bool:
    """Whether the state ops call the C++ CPU kernels (builds them on the first call)."""
    global _decision
    if _decision is None:
        _decision = bool(
            current_platform.is_cpu and cpu_kernels.is_available() and cpu_kernels.active_isa() != "portable"
        )
    return _decision
