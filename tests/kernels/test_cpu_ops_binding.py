"""The operator functions call the active build's operators, resolved once per choice of
build (``runtime.on_change``): a new level (``using_isa``) or a re-read of
``PAGEDLLM_DISABLE_CPU_KERNELS`` rebinds them at their next call."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import ops


def _namespace(level: str):
    return getattr(torch.ops, f"pagedllm_cpu_{level}")


def test_operators_follow_the_disable_toggle(kernel, disable_cpu_kernels):
    x, weight = torch.randn(2, 8), torch.ones(8)
    expected = kernel.rms_norm(x, weight, 1e-6)
    assert ops._ns is _namespace(kernel.active_isa())
    disable_cpu_kernels()
    with pytest.raises(RuntimeError, match="unavailable: disabled by PAGEDLLM_DISABLE_CPU_KERNELS"):
        kernel.rms_norm(x, weight, 1e-6)
    disable_cpu_kernels(False)
    assert torch.equal(kernel.rms_norm(x, weight, 1e-6), expected)
    assert ops._ns is _namespace(kernel.active_isa())


@pytest.mark.isa_levels
def test_operators_follow_using_isa(kernel):
    logits = torch.randn(3, 40)
    kernel.argmax_rows(logits)
    level = kernel.active_isa()
    with kernel.using_isa("portable"):
        assert torch.equal(kernel.argmax_rows(logits), logits.argmax(-1))
        assert ops._ns is _namespace("portable")
    assert torch.equal(kernel.argmax_rows(logits), logits.argmax(-1))
    assert ops._ns is _namespace(level)
