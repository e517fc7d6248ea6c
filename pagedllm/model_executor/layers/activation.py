"""Gated activations on a fused [gate | up] input: SwiGLU (Shazeer 2020, arXiv:2002.05202)
and its GELU variant GeGLU (Gemma's MLP), and gpt-oss's clamped variant; and the squared
ReLU of ungated MLPs (Nemotron-H's "relu2")."""

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.custom_op import CustomOp

#: ``GeluAndMul``'s approximations (``torch.nn.functional.gelu``'s ``approximate``).
GELU_APPROXIMATIONS = ("none", "tanh")


class SiluAndMul(CustomOp):
    """[..., 2d] -> [..., d]: silu(x[..., :d]) * x[..., d:]."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        # NOTE: multiplying in place into silu's fresh output saves one [T, d] buffer,
        # ~30% of this op's time on CPU.
        return F.silu(gate).mul_(up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return cpu_kernels.silu_and_mul(x)
        return self.forward_native(x)


class GeluAndMul(CustomOp):
    """[..., 2d] -> [..., d]: gelu(x[..., :d]) * x[..., d:], in the input dtype (vLLM's name).

    ``approximate`` "tanh" is transformers' ``gelu_pytorch_tanh`` (Gemma's
    ``hidden_activation``), "none" the exact erf form (``gelu``).

    Raises:
        ValueError: another ``approximate``.
    """

    def __init__(self, approximate: str = "none") -> None:
        if approximate not in GELU_APPROXIMATIONS:
            raise ValueError(f"GeluAndMul approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}.")
        super().__init__()
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate).mul_(up)


class SwigluOAIAndMul(CustomOp):
    """[..., 2d] -> [..., d]: gpt-oss's clamped SwiGLU on [gate | up] halves (transformers'
    ``GptOssExperts._apply_gate``, vLLM's "swigluoai"): gate clamped above at ``limit``, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.alpha, self.limit = float(alpha), float(limit)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return up.clamp(-self.limit, self.limit).add_(1.0).mul_(glu)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


class ReLUSquaredActivation(nn.Module):
    """[..., d] -> [..., d]: relu(x) ** 2 (transformers' ``ACT2FN["relu2"]``; vLLM's name), no gate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))
