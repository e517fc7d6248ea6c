"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), computed in float32 as HF Llama does,
and Gemma's variant that scales by (1 + weight)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.custom_op import CustomOp


class RMSNorm(CustomOp):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension.

    With ``residual`` given, first adds it (in the input dtype) and returns
    ``(normed, new_residual)`` so the caller keeps the residual stream.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.variance_epsilon))
        # ``normed`` is a fresh tensor (``.to`` returns it as is for float32): safe to scale in place.
        return normed.to(x.dtype).mul_(self.weight)

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """With ``residual`` given, both ``x`` and ``residual`` are overwritten (the caller
        must no longer need them): the results are written into their buffers."""
        if residual is None:
            return self._norm(x)
        x = x.add_(residual)
        return self._norm(x), x

    def forward_cpu(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """As ``forward_native``, in one pass by the fused C++ kernels (``pagedllm.kernels.cpu``)."""
        if residual is None:
            return cpu_kernels.rms_norm(x, self.weight, self.variance_epsilon)
        cpu_kernels.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        return x, residual


class GemmaRMSNorm(RMSNorm):
    """y = x / sqrt(mean(x^2) + eps) * (1 + weight), over the last dimension, all in float32
    and rounded once to the input dtype (transformers' ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``;
    vLLM's name). The checkpoint's ``weight`` is the offset from 1 (zeros: the identity scale).
    ``residual`` as ``RMSNorm``'s (added in the input dtype, as transformers adds the stream).
    """

    # The C++ kernels scale by ``weight`` itself: the portable path on every device.
    forward_cpu = CustomOp.forward_cpu

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.variance_epsilon))
        return normed.mul_(self.weight.float() + 1.0).to(x.dtype)
