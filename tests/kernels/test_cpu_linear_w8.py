"""``linear_w8`` (int8 weights with one float32 scale per output, in ``pack_w8``'s blocks)
equals the float64 product within float32 summation error, at every instruction-set level the
host supports (the streaming kernel from AVX2 up, the widening GEMM on the portable level), for
ragged shapes and with or without bias; more than 16 rows (``linear_dequant``'s) and bad input
are refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers import cpu_gemm
from tests.grids import latin_grid

pytestmark = pytest.mark.usefixtures("isa_kernel")

SHAPES = [(1, 1), (37, 33), (130, 7), (200, 96), (67, 896)]


def _random_int8(n: int, k: int) -> torch.Tensor:
    return torch.randint(-127, 128, (n, k), dtype=torch.int8)


# Rows: tiles of 4, 3, 2 and 1 rows; each with both x dtypes, every shape with both.
@pytest.mark.parametrize("shape,rows,x_dtype", latin_grid(SHAPES, [1, 2, 3, 5, 16], [torch.float32, torch.bfloat16]))
def test_matches_float64_product(shape, rows, x_dtype):
    n, k = shape
    torch.manual_seed(n * 31 + k + rows)
    q = _random_int8(n, k)
    scale = torch.rand(n) * 0.01 + 1e-4
    x = torch.randn(rows, k).to(x_dtype)
    bias = torch.randn(n) if rows % 2 else None
    got = cpu_kernels.linear_w8(x, cpu_kernels.pack_w8(q), scale, bias, n)
    assert got.shape == (rows, n) and got.dtype == x_dtype
    dot = x.double() @ q.double().T
    exact = dot * scale.double() + (0 if bias is None else bias.double())
    # float32 FMA sums (Higham 3.5: (k + 1) u sum|x q|), then the scale and the bias round once each.
    magnitude = (x.double().abs() @ q.double().abs().T) * scale.double() + (0 if bias is None else bias.double().abs())
    bound = (k + 3) * 2.0**-24 * magnitude
    if x_dtype != torch.float32:
        bound = bound + exact.abs() * torch.finfo(x_dtype).eps
    err = (got.double() - exact).abs()
    assert bool((err <= bound + 1e-30).all()), float((err - bound).max())


def test_pack_w8_layout():
    q = _random_int8(20, 5)
    packed = cpu_kernels.pack_w8(q)
    assert packed.shape == (2, 5, 16) and packed.dtype == torch.int8
    for n in range(20):
        assert torch.equal(packed[n // 16, :, n % 16], q[n])
    assert not packed[1, :, 4:].any()  # the last block's padding


def test_bad_input_is_refused():
    q = cpu_kernels.pack_w8(_random_int8(32, 8))
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="pack_w8: weight must be an int8"):
        cpu_kernels.pack_w8(torch.randn(4, 4))
    with pytest.raises(RuntimeError, match=r"linear_w8: scale must be a contiguous float32 CPU tensor \[32\]"):
        cpu_kernels.linear_w8(x, q, torch.ones(31), None, 32)
    with pytest.raises(RuntimeError, match="linear_w8: N = 40 does not match"):
        cpu_kernels.linear_w8(x, q, torch.ones(40), None, 40)
    with pytest.raises(RuntimeError, match="linear_w8: weight must be a CPU tensor of dtype int8"):
        cpu_kernels.linear_w8(x, q.float(), torch.ones(32), None, 32)
    with pytest.raises(RuntimeError, match=r"linear_w8: x has 17 rows; this kernel takes at most 16 \(more rows: linear_dequant\)"):
        cpu_kernels.linear_w8(torch.randn(cpu_kernels.FEW_ROWS_MAX + 1, 8), q, torch.ones(32), None, 32)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2])  # the streaming kernel's tiles
def test_fp8_matches_float64_product(n, k, rows):
    """``linear_fp8``: float8 e4m3 weights (every finite value, subnormals included) widened
    exactly, with one scale per output."""
    gen = torch.Generator().manual_seed(n * 7 + k + rows)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    codes[(codes & 0x7F) == 0x7F] = 0  # NaN codes: never written by a quantizer
    f8 = codes.view(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    x = torch.randn(rows, k, generator=gen)
    packed = cpu_kernels.pack_w8(codes.view(torch.int8)).view(torch.float8_e4m3fn)
    got = cpu_kernels.linear_fp8(x, packed, scale, None, n)
    w = f8.double()
    exact = (x.double() @ w.T) * scale.double()
    bound = (k + 2) * 2.0**-24 * (x.double().abs() @ w.abs().T) * scale.double()
    assert bool(((got.double() - exact).abs() <= bound + 1e-30).all())


def test_fp8_needs_float8_weights():
    packed = cpu_kernels.pack_w8(_random_int8(16, 8))
    with pytest.raises(RuntimeError, match="linear_fp8: weight must be a CPU tensor of dtype float8_e4m3fn"):
        cpu_kernels.linear_fp8(torch.randn(1, 8), packed, torch.ones(16), None, 16)
    fp8 = packed.view(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="linear_fp8: x has 17 rows; this kernel takes at most 16"):
        cpu_kernels.linear_fp8(torch.randn(17, 8), fp8, torch.ones(16), None, 16)


def test_layers_switch_to_linear_dequant_within_the_few_row_limit():
    """The few-row kernels refuse more than ``FEW_ROWS_MAX`` rows: the quantized layers'
    switch to ``linear_dequant`` must come no later."""
    assert all(rows <= cpu_kernels.FEW_ROWS_MAX + 1 for rows in cpu_gemm.DEQUANT_GEMM_MIN_ROWS.values())
