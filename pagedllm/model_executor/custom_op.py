"""``CustomOp``: one dispatch point for a layer with device-specific implementations.

A subclass writes ``forward_native`` (portable PyTorch, the reference) and overrides
``forward_cpu`` / ``forward_cuda`` where a native kernel exists. The implementation is
chosen once, at construction, from ``platforms.current_platform`` (the pattern of vLLM's
``CustomOp``); layers never test ``device.type`` themselves.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.platforms import current_platform


class CustomOp(nn.Module):
    """A module whose ``forward`` is ``forward_<platform>``, bound at construction.

    ``forward_cpu`` and ``forward_cuda`` default to ``forward_native``. An overridden
    ``forward_cpu`` is the C++ kernels' path (``pagedllm.kernels.cpu``): it runs only where
    ``cpu_kernels.is_available()``, asked once, at the module's first call (not at
    construction, so that building a module never builds the kernels); else
    ``forward_native`` runs.
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
        """The implementation for ``current_platform``: ``forward_<device_type>`` (on CPU an
        overridden ``forward_cpu`` is chosen at the first call: ``_forward_cpu_once``)."""
        if current_platform.is_cpu and type(self).forward_cpu is not CustomOp.forward_cpu:
            return self._forward_cpu_once
        return getattr(self, f"forward_{current_platform.device_type}", self.forward_native)

    def _forward_cpu_once(self, *args: Any, **kwargs: Any) -> Any:
        """Bind ``forward_cpu`` where the C++ kernels are available, else ``forward_native``,
        for this and every later call."""
        self._forward_method = self.forward_cpu if cpu_kernels.is_available() else self.forward_native
        return self._forward_method(*args, **kwargs)
