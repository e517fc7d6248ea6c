"""Gated activations on a fused [gate | up] input: SwiGLU (Shazeer 2020, arXiv:2002.05202)
and its GELU variant GeGLU (Gemma's MLP)."""

import torch
import torch.nn.functional as F
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
