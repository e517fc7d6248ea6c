"""Gemma's layer variants against transformers' modules, bit for bit in float32 and bfloat16:
``GemmaRMSNorm`` ((1 + w) scale, with and without the residual add) and ``GeluAndMul``
(``gelu_pytorch_tanh`` and ``gelu``)."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from pagedllm.model_executor.layers.activation import GeluAndMul
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_equals_transformers(dtype):
    torch.manual_seed(0)
    ours, theirs = GemmaRMSNorm(64, eps=1e-6), Gemma3RMSNorm(64, eps=1e-6)
    assert torch.equal(ours.weight, torch.zeros(64))  # the checkpoint's offset from 1
    weight = torch.randn(64) * 0.5
    ours.weight.data.copy_(weight.to(dtype))
    theirs.weight.data.copy_(weight.to(dtype))
    theirs = theirs.to(dtype)
    x, residual = torch.randn(5, 64, dtype=dtype) * 3, torch.randn(5, 64, dtype=dtype)
    assert torch.equal(ours(x.clone()), theirs(x))
    normed, stream = ours(x.clone(), residual.clone())
    assert torch.equal(stream, x + residual)
    assert torch.equal(normed, theirs(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("activation", "approximate"), [("gelu_pytorch_tanh", "tanh"), ("gelu", "none")])
def test_gelu_and_mul_equals_transformers(activation, approximate, dtype):
    torch.manual_seed(1)
    x = torch.randn(7, 2 * 48, dtype=dtype) * 2
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(GeluAndMul(approximate)(x), ACT2FN[activation](gate) * up)


def test_gelu_and_mul_refuses_an_unknown_approximation():
    with pytest.raises(ValueError, match="approximate must be one of .*'sigmoid'"):
        GeluAndMul("sigmoid")
