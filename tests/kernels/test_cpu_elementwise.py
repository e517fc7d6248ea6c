"""The fused C++ CPU kernels (RMSNorm, residual add + RMSNorm, SwiGLU, rotary embedding)
against the PyTorch formulas of Hugging Face's Llama, on shapes with vector tails, strided
views and every dtype; and the model layers' use of them."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.activation import SiluAndMul
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, _rotate

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: 896 (Qwen2.5-0.5B), 64 (a head), 40 (a vector and a tail), 7 (tail only)
WIDTHS = [896, 64, 40, 7]


pytestmark = pytest.mark.usefixtures("isa_kernel")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def assert_close_ulps(
    actual: torch.Tensor, expected: torch.Tensor, max_mismatch: float = 0.01, sum_terms: int = 0
) -> None:
    """Within a few units in the last place of the dtype; for 16-bit dtypes also exactly
    equal but for a small fraction of elements (a float32 sum in another order crosses a
    bf16 / fp16 rounding boundary only rarely; in float32 it moves every row's last bits).

    ``sum_terms``: the values went through a float32 sum of that many non-negative terms
    (RMSNorm's sum of squares) whose order differs from PyTorch's, by vector width and ISA.
    Each order is within ``(n - 1) u`` of the exact sum (u = 2^-24; Higham, "Accuracy and
    Stability of Numerical Algorithms", 2nd ed., section 4.2), so two orders differ by up to
    ``2 (n - 1) u`` relative, and ``rsqrt`` halves that: float32 results may differ by
    ``(n - 1) u`` relative on top of their own few roundings."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    eps = torch.finfo(actual.dtype).eps
    diff = (actual.float() - expected.float()).abs()
    order = max(sum_terms - 1, 0) * 2.0**-24 if actual.dtype == torch.float32 else 0.0
    tol = (4 * eps + order) * expected.float().abs().clamp_min(1e-3)
    assert bool((diff <= tol).all()), f"max diff {diff.max().item()}"
    if actual.dtype != torch.float32:
        assert (actual != expected).float().mean().item() <= max_mismatch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_matches_hf(dtype, width):
    torch.manual_seed(width)
    x = torch.randn(37, width).to(dtype) * 3
    weight = torch.randn(width).to(dtype)
    assert_close_ulps(cpu_kernels.rms_norm(x, weight, 1e-6), hf_rms_norm(x, weight, 1e-6), sum_terms=width)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_heads(dtype):
    """Qwen3's q_norm: [T, H, D] heads that are a view into the fused qkv output."""
    torch.manual_seed(0)
    qkv = torch.randn(5, 3 * 4 * 64).to(dtype)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    weight = torch.randn(64).to(dtype)
    out = cpu_kernels.rms_norm(q, weight, 1e-5)
    assert out.shape == (5, 4, 64) and out.is_contiguous()
    assert_close_ulps(out, hf_rms_norm(q, weight, 1e-5), sum_terms=64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_fused_add_rms_norm_in_place(dtype, width):
    torch.manual_seed(width)
    x = torch.randn(9, width).to(dtype)
    residual = torch.randn(9, width).to(dtype)
    weight = torch.randn(width).to(dtype)
    expected_sum = residual + x
    expected = hf_rms_norm(expected_sum, weight, 1e-6)
    cpu_kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_sum)  # the residual add rounds exactly as PyTorch's
    assert_close_ulps(x, expected, sum_terms=width)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [4864, 48, 5])
def test_silu_and_mul_matches_hf(dtype, width):
    torch.manual_seed(width)
    x = (torch.randn(11, 2 * width) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = cpu_kernels.silu_and_mul(x)
    assert out.shape == (11, width)
    assert_close_ulps(out, expected, max_mismatch=0.001)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 64, 40])
def test_rotary_in_place_matches_hf(dtype, head_dim):
    torch.manual_seed(head_dim)
    num_tokens, hq, hk = 6, 4, 2
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * head_dim).to(dtype)
    q = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(num_tokens, hk, head_dim)
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    angles = torch.rand(num_tokens, head_dim // 2) * 10
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)
    expected_q, expected_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    out_q, out_k = RotaryEmbedding(head_dim, 8, 10000.0)(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    if dtype == torch.float32:  # PyTorch may fuse multiply-adds: last-bit differences
        torch.testing.assert_close(out_q, expected_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out_k, expected_k, rtol=1e-6, atol=1e-6)
    else:  # every rounding where HF's code rounds: bit-identical
        assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before)  # v untouched


def test_layers_use_kernels_and_match_the_torch_path(disable_cpu_kernels):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(torch.bfloat16)
    norm.weight.data.normal_()
    x = torch.randn(8, 96, dtype=torch.bfloat16)
    residual = torch.randn(8, 96, dtype=torch.bfloat16)
    act_in = torch.randn(8, 2 * 80, dtype=torch.bfloat16)
    fast_norm = norm(x.clone())
    fast_pair = norm(x.clone(), residual.clone())
    fast_act = SiluAndMul()(act_in)
    disable_cpu_kernels()
    assert not cpu_kernels.is_available()
    # layers built after the toggle take the torch path (a layer decides at its first call)
    slow = RMSNorm(96, 1e-6).to(torch.bfloat16)
    slow.weight.data.copy_(norm.weight.data)
    assert slow(x.clone()) is not None and slow._forward_method == slow.forward_native
    assert norm._forward_method == norm.forward_cpu
    assert_close_ulps(fast_norm, slow(x.clone()))
    slow_pair = slow(x.clone(), residual.clone())
    assert_close_ulps(fast_pair[0], slow_pair[0])
    assert torch.equal(fast_pair[1], slow_pair[1])
    assert_close_ulps(fast_act, SiluAndMul()(act_in), max_mismatch=0.01)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: cpu_kernels.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-6), "weight must be"),
        (lambda: cpu_kernels.rms_norm(torch.randn(4, 8), torch.randn(8, dtype=torch.bfloat16), 1e-6), "one dtype"),
        (lambda: cpu_kernels.silu_and_mul(torch.randn(4, 8, dtype=torch.float64)), "unsupported dtype"),
        (lambda: cpu_kernels.fused_add_rms_norm(torch.randn(4, 8), torch.randn(3, 8), torch.randn(8), 1e-6),
         "must be"),
        (lambda: cpu_kernels.rotary_embedding(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.randn(2, 6),
                                              torch.randn(2, 6)), "cos and sin"),
    ],
)
def test_bad_arguments_raise(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()
