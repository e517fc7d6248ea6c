"""``packed_linear`` (few-row matmul reading oneDNN-packed bf16 weights) equals the float64
product rounded once to bf16, as closely as oneDNN's own matmul does, on ragged shapes,
strided inputs and with or without bias; ``linear`` routes few-row inputs to it once
``pack_weight`` has checked the shape, and bad input is refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers import linear as linear_mod
from tests.grids import latin_grid

pytestmark = pytest.mark.usefixtures("kernel")


@pytest.fixture(scope="module")
def bf16_kernel(kernel):
    if not kernel.has_packed_linear():
        pytest.skip(f"this CPU/build has no AVX512-BF16 ({kernel.build_info()}): packed_linear is not used here")
    if not linear_mod.packed_linear_reads(200, 96):
        pytest.skip("oneDNN packs bf16 weights in a layout packed_linear does not read on this CPU: it is not used here")
    return kernel


@pytest.fixture(scope="module")
def block_n(bf16_kernel):
    """The outputs per block of oneDNN's packed bf16 layout here: 64, or 32 with AMX."""
    return linear_mod._packed_linear_shapes[(200, 96)]


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def _onednn(x, packed, bias):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# (N, K): multiples of the 64 x 32 blocks, ragged N, ragged and odd K, a model's shapes.
SHAPES = [(64, 32), (200, 96), (37, 33), (130, 7), (1152, 896), (896, 4864)]


# Every shape and every row count with each bias (latin_grid).
@pytest.mark.parametrize("shape,rows,bias_dtype", latin_grid(SHAPES, [1, 2, 3, 4, 5, 8, 13, 16], [None, torch.bfloat16, torch.float32]))
def test_matches_float64_product_like_onednn(bf16_kernel, block_n, shape, rows, bias_dtype):
    n, k = shape
    torch.manual_seed(n * 31 + k + rows)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    packed = _pack(w)
    got = bf16_kernel.packed_linear(x, packed, bias, block_n)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    # float32 sums of exact bf16 products, rounded once: within one bf16 rounding (2^-8
    # relative) plus the float32 summation error; oneDNN's own error is the yardstick.
    ours = (got.double() - exact).abs()
    theirs = (_onednn(x, packed, bias).double() - exact).abs()
    bound = exact.abs() * 2**-8 + 1e-5 * k**0.5 * exact.abs().max()
    assert bool((ours <= bound).all()), float((ours - bound).max())
    assert float(ours.max()) <= 1.5 * float(theirs.max()) + 1e-6


def test_strided_and_odd_row_stride_inputs(bf16_kernel, block_n):
    torch.manual_seed(0)
    w = torch.randn(100, 40).to(torch.bfloat16)
    packed = _pack(w)
    wide = torch.randn(6, 63).to(torch.bfloat16)
    for x in (wide[:, 3:43], wide[::2, :40], torch.randn(40, 5).to(torch.bfloat16).T):
        expected = bf16_kernel.packed_linear(x.contiguous(), packed, None, block_n)
        assert torch.equal(bf16_kernel.packed_linear(x, packed, None, block_n), expected)


def test_bad_input_is_refused(bf16_kernel, block_n):
    w = torch.randn(64, 32).to(torch.bfloat16)
    packed = _pack(w)
    with pytest.raises(RuntimeError, match="oneDNN-packed"):
        bf16_kernel.packed_linear(torch.randn(1, 32).to(torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match=r"\[M, 32\]"):
        bf16_kernel.packed_linear(torch.randn(1, 31).to(torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match=r"\[M, 32\]"):
        bf16_kernel.packed_linear(torch.randn(1, 32), packed, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[64\]"):
        bf16_kernel.packed_linear(torch.randn(1, 32).to(torch.bfloat16), packed, torch.zeros(63))
    with pytest.raises(RuntimeError, match="block_n must be 64 or 32"):
        bf16_kernel.packed_linear(torch.randn(1, 32).to(torch.bfloat16), packed, None, 16)


def test_the_other_block_width_does_not_match(bf16_kernel, block_n):
    """The layout check can tell the blockings apart: read with the other width, a packed
    weight of several blocks gives another product (or a size mismatch)."""
    torch.manual_seed(5)
    w = torch.randn(256, 64).to(torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    packed = _pack(w)
    other = 96 - block_n
    try:
        got = bf16_kernel.packed_linear(x, packed, None, other)
    except RuntimeError as exc:
        assert "blocked layout" in str(exc)
    else:
        assert not torch.allclose(got.float(), _onednn(x, packed, None).float(), rtol=2**-7, atol=1e-2)


def test_linear_routes_few_rows_to_the_kernel(bf16_kernel, block_n, monkeypatch):
    torch.manual_seed(3)
    w = torch.randn(72, 48).to(torch.bfloat16)
    bias = torch.randn(72).to(torch.bfloat16)
    packed = linear_mod.pack_weight(w)
    assert (72, 48) in linear_mod._packed_linear_shapes
    calls = []
    real = bf16_kernel.packed_linear
    monkeypatch.setattr(bf16_kernel, "packed_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, linear_mod.SMALL_M_ROWS, linear_mod.SMALL_M_ROWS + 1, 64):
        x = torch.randn(rows, 48).to(torch.bfloat16)
        expected = _onednn(x, packed, bias)
        torch.testing.assert_close(linear_mod.linear(x, packed, bias), expected, rtol=2**-7, atol=1e-2)
    assert calls == [1, linear_mod.SMALL_M_ROWS]
    # float32 weights keep oneDNN's matmul (a different packed layout).
    packed32 = linear_mod.pack_weight(torch.randn(72, 48))
    assert packed32.dtype == torch.float32 and (72, 48) in linear_mod._packed_linear_shapes
    linear_mod.linear(torch.randn(2, 48), packed32)
    assert calls == [1, linear_mod.SMALL_M_ROWS]
