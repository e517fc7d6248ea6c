"""``CustomOp``: one dispatch point for a layer with device-specific implementations.

A subclass writes ``forward_native`` (portable PyTorch, the reference) and overrides
``forward_cpu`` / ``forward_cuda`` where a native kernel exists. The implementation is
chosen once, at construction, from ``platforms.current_platform`` (the pattern of vLLM's
``CustomOp``); layers never test ``device.type`` themselves.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from pagedllm.platforms import current_platform


class CustomOp(nn.Module):
    """A module whose ``forward`` is ``forward_<platform>``, bound at construction.

    ``forward_cpu`` and ``forward_cuda`` default to ``forward_native``. A ``forward_cpu``
    that calls ``pagedllm.kernels.cpu`` still asks ``cpu_kernels.is_available()`` per call
    (the kernels may be disabled by ``PAGEDLLM_DISABLE_CPU_KERNELS`` or a failed build; once
    decided, the answer is two global reads) and falls back to ``forward_native``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._forward_method = self.dispatch_forward()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The portable PyTorch implementation (the reference the others are tested against)."""
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def dispatch_forward(self) -> Callable[..., Any]:
        """The implementation for ``current_platform``: ``forward_<device_type>``."""
        return getattr(self, f"forward_{current_platform.device_type}", self.forward_native)
