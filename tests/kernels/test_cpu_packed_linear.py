"""``packed_linear`` (few-row matmul reading oneDNN-packed bf16 weights) equals the float64
product rounded once to bf16, as closely as oneDNN's own matmul does, on ragged shapes,
strided inputs and with or without bias, on each of its paths this CPU has (vdpbf16ps; AMX
tiles, whose product is oneDNN's own, row by row the same at any row count); ``linear``
routes few-row inputs to it once ``pack_weight`` has checked the shape, and bad input is
refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers import cpu_gemm
from tests.grids import latin_grid

pytestmark = pytest.mark.usefixtures("kernel")


@pytest.fixture(scope="module")
def bf16_kernel(kernel):
    if not kernel.has_packed_linear():
        pytest.skip(f"this CPU/build has no AVX512-BF16 ({kernel.build_info()}): packed_linear is not used here")
    if not cpu_gemm.packed_linear_reads(200, 96):
        pytest.skip("oneDNN packs bf16 weights in a layout packed_linear does not read on this CPU: it is not used here")
    return kernel


@pytest.fixture(scope="module")
def block_n(bf16_kernel):
    """The outputs per block of oneDNN's packed bf16 layout here: 64, or 32 with AMX."""
    return cpu_gemm._packed_linear_shapes[(200, 96)][0]


@pytest.fixture(scope="module")
def paths(bf16_kernel, block_n):
    """The kernel's paths on this CPU (its ``amx`` argument): vdpbf16ps, and AMX tiles where
    the layout has 32-output blocks and the CPU and OS allow them."""
    return [False, True] if block_n == 32 and bf16_kernel.has_amx() else [False]


@pytest.fixture(scope="module")
def amx_kernel(bf16_kernel, paths):
    if True not in paths:
        pytest.skip(f"no AMX tiles here (block width {cpu_gemm._packed_linear_shapes[(200, 96)][0]})")
    return bf16_kernel


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def _onednn(x, packed, bias):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# (N, K): multiples of the 64 x 32 blocks, ragged N, ragged and odd K, a model's shapes.
SHAPES = [(64, 32), (200, 96), (37, 33), (130, 7), (1152, 896), (896, 4864)]


# Every shape and every row count with each bias (latin_grid).
@pytest.mark.parametrize("shape,rows,bias_dtype", latin_grid(SHAPES, [1, 2, 3, 4, 5, 8, 13, 16], [None, torch.bfloat16, torch.float32]))
def test_matches_float64_product_like_onednn(bf16_kernel, block_n, paths, shape, rows, bias_dtype):
    n, k = shape
    torch.manual_seed(n * 31 + k + rows)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    packed = _pack(w)
    theirs = (_onednn(x, packed, bias).double() - exact).abs()
    for amx in paths:
        got = bf16_kernel.packed_linear(x, packed, bias, block_n, amx)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        # float32 sums of exact bf16 products, rounded once: within one bf16 rounding (2^-8
        # relative) plus the float32 summation error; oneDNN's own error is the yardstick.
        ours = (got.double() - exact).abs()
        bound = exact.abs() * 2**-8 + 1e-5 * k**0.5 * exact.abs().max()
        assert bool((ours <= bound).all()), (amx, float((ours - bound).max()))
        assert float(ours.max()) <= 1.5 * float(theirs.max()) + 1e-6, amx


def test_strided_and_odd_row_stride_inputs(bf16_kernel, block_n, paths):
    torch.manual_seed(0)
    w = torch.randn(100, 40).to(torch.bfloat16)
    packed = _pack(w)
    wide = torch.randn(6, 63).to(torch.bfloat16)
    for amx in paths:
        for x in (wide[:, 3:43], wide[::2, :40], torch.randn(40, 5).to(torch.bfloat16).T):
            expected = bf16_kernel.packed_linear(x.contiguous(), packed, None, block_n, amx)
            assert torch.equal(bf16_kernel.packed_linear(x, packed, None, block_n, amx), expected)


# The shipped model's and the 0.5B shape's qkv and down projections, and a ragged one.
@pytest.mark.parametrize("shape", [(512, 256), (256, 704), (1152, 896), (200, 96)])
def test_amx_tiles_give_onednns_product_whatever_the_row_count(amx_kernel, shape):
    """AMX tiles sum each chunk of 32 inputs as oneDNN's AMX matmul does: bit-identical
    products, and each row's result is the same in a product of 1 to 16 rows (at batch 1, a
    verifying step's logits are a plain decode step's)."""
    n, k = shape
    torch.manual_seed(n + k)
    packed = _pack(torch.randn(n, k).to(torch.bfloat16))
    bias = torch.randn(n).to(torch.bfloat16)
    x = torch.randn(16, k).to(torch.bfloat16)
    single = torch.cat([amx_kernel.packed_linear(x[r : r + 1], packed, bias, 32, True) for r in range(16)])
    for rows in (1, 2, 3, 5, 8, 13, 16):
        got = amx_kernel.packed_linear(x[:rows], packed, bias, 32, True)
        assert torch.equal(got, _onednn(x[:rows], packed, bias)), rows
        assert torch.equal(got, single[:rows]), rows


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
    with pytest.raises(RuntimeError, match="amx needs block_n 32"):
        bf16_kernel.packed_linear(torch.randn(1, 32).to(torch.bfloat16), packed, None, 64, True)


def test_amx_takes_at_most_16_rows(amx_kernel):
    packed = _pack(torch.randn(64, 32).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="at most 16 rows, not 17"):
        amx_kernel.packed_linear(torch.randn(17, 32).to(torch.bfloat16), packed, None, 32, True)


def test_below_avx512_bf16_there_is_neither_path(isa_kernel):
    if isa_kernel.build_info().startswith("avx512_bf16"):
        pytest.skip("the avx512_bf16 level has the kernel (the tests above)")
    assert not isa_kernel.has_packed_linear() and not isa_kernel.has_amx()
    with pytest.raises(RuntimeError, match="no AVX512-BF16"):
        isa_kernel.packed_linear(torch.randn(1, 32).to(torch.bfloat16), torch.zeros(32, 32), None, 32, True)


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
    packed = cpu_gemm.pack_weight(w)
    assert (72, 48) in cpu_gemm._packed_linear_shapes
    calls = []
    real = bf16_kernel.packed_linear
    monkeypatch.setattr(bf16_kernel, "packed_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, cpu_gemm.SMALL_M_ROWS, cpu_gemm.SMALL_M_ROWS + 1, 64):
        x = torch.randn(rows, 48).to(torch.bfloat16)
        expected = _onednn(x, packed, bias)
        torch.testing.assert_close(cpu_gemm.linear(x, packed, bias), expected, rtol=2**-7, atol=1e-2)
    assert calls == [1, cpu_gemm.SMALL_M_ROWS]
    assert cpu_gemm._packed_linear_shapes[(72, 48)] == (block_n, block_n == 32 and bf16_kernel.has_amx())
    # float32 weights keep oneDNN's matmul (a different packed layout).
    packed32 = cpu_gemm.pack_weight(torch.randn(72, 48))
    assert packed32.dtype == torch.float32 and (72, 48) in cpu_gemm._packed_linear_shapes
    cpu_gemm.linear(torch.randn(2, 48), packed32)
    assert calls == [1, cpu_gemm.SMALL_M_ROWS]
