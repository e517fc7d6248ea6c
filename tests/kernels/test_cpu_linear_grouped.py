"""``linear_w4`` and ``linear_w8g`` (4- and 8-bit weights with a float32 scale and zero point
per group of inputs, in ``pack_w4``'s / ``pack_w8``'s blocks) equal the float64 product of the
dequantized weight within float32 summation error, at every instruction-set level the host
supports (the streaming kernels from AVX2 up, the dequantizing GEMM on the portable level), for
ragged shapes, group boundaries and with or without bias; float16 scales, symmetric weights
without zero points and ``pack_groups``' blocked scales (the compact storage) give exactly what
their float32 [N, G] form gives; more than
16 rows (``linear_dequant``'s) and bad input are refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu as cpu_kernels
from tests.grids import latin_grid

pytestmark = pytest.mark.usefixtures("isa_kernel")

# (N, K, group size): odd N, one group per row (channel-wise), groups of 2, 16 (GGUF's Q6_K),
# 32 and 128.
SHAPES = [(1, 2, 2), (37, 64, 32), (130, 8, 8), (200, 256, 128), (67, 896, 128), (17, 96, 32), (40, 512, 16)]
# (bits, x dtype), alternating bits: with latin_grid over shapes and rows, every row tiling meets
# each pair, and every shape both widths.
VARIANTS = [(4, torch.float32), (8, torch.bfloat16), (4, torch.bfloat16), (8, torch.float32)]


def _random_case(n: int, k: int, group: int, seed: int, bits: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-4
    zero = torch.randint(0, 2**bits, (n, k // group), generator=gen).float()
    zero[::2] += torch.rand(zero[::2].shape, generator=gen)  # fractional zero points (GGUF's Q4_1, Q4_K)
    return q, scale, zero


def _linear(bits: int, x, q, scale, zero, bias, n, int8_activations: bool = False):
    if bits == 4:
        return cpu_kernels.linear_w4(x, cpu_kernels.pack_w4(q), scale, zero, bias, n, int8_activations)
    packed = cpu_kernels.pack_w8(q.view(torch.int8)).view(torch.uint8)
    return cpu_kernels.linear_w8g(x, packed, scale, zero, bias, n, int8_activations)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // scale.shape[1]
    s = scale.double().repeat_interleave(group, dim=1)
    z = zero.double().repeat_interleave(group, dim=1)
    return s * (q.double() - z)


@pytest.mark.parametrize("shape,rows,variant", latin_grid(SHAPES, [1, 2, 3], VARIANTS))  # tiles of 2 and 1 rows
def test_matches_float64_product(shape, rows, variant):
    (n, k, group), (bits, x_dtype) = shape, variant
    q, scale, zero = _random_case(n, k, group, n * 31 + k + rows, bits)
    x = torch.randn(rows, k).to(x_dtype)
    bias = torch.randn(n) if rows % 2 else None
    got = _linear(bits, x, q, scale, zero, bias, n)
    assert got.shape == (rows, n) and got.dtype == x_dtype
    w = _dequantize(q, scale, zero)
    exact = x.double() @ w.T + (0 if bias is None else bias.double())
    # float32 sums of exact products (Higham 3.5), over x * Q and over x * zero, each scaled once.
    s = scale.double().repeat_interleave(group, dim=1)
    z = zero.double().repeat_interleave(group, dim=1)
    magnitude = x.double().abs() @ (s * (q.double() + z)).T + (0 if bias is None else bias.double().abs())
    bound = (k + 4) * 2.0**-24 * magnitude
    if x_dtype != torch.float32:
        bound = bound + exact.abs() * torch.finfo(x_dtype).eps
    err = (got.double() - exact).abs()
    assert bool((err <= bound + 1e-30).all()), float((err - bound).max())


# (N, K, group size): ragged last blocks (the gathers' clamped lanes, pack_groups' padding), N *
# groups odd (the float16 gather's last aligned word), one group per row, groups of 32 and 128.
COMPACT_SHAPES = [(37, 64, 32), (17, 96, 32), (1, 32, 32), (67, 896, 128), (21, 160, 160), (130, 8, 8)]


@pytest.mark.parametrize("shape", COMPACT_SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_float16_scales_and_symmetric_weights_equal_their_float32_form(shape, bits):
    n, k, group = shape
    q, scale, _ = _random_case(n, k, group, n * 7 + k, bits)
    scale16 = scale.half()
    mid = torch.full(scale.shape, float(2 ** (bits - 1)))
    misaligned = torch.empty(scale16.numel() + 1, dtype=torch.float16)[1:].view(scale16.shape)  # 2 bytes off
    misaligned.copy_(scale16)
    for rows, x_dtype, int8_activations in ((1, torch.bfloat16, True), (3, torch.float32, True), (2, torch.bfloat16, False)):
        x = torch.randn(rows, k).to(x_dtype)
        bias = torch.randn(n) if rows % 2 else None
        expected = _linear(bits, x, q, scale16.float(), mid, bias, n, int8_activations)
        for s16 in (scale16, misaligned, cpu_kernels.pack_groups(scale16)):
            assert torch.equal(_linear(bits, x, q, s16, None, bias, n, int8_activations), expected)
        assert torch.equal(_linear(bits, x, q, scale16, mid, bias, n, int8_activations), expected)
        assert torch.equal(_linear(bits, x, q, scale16.float(), None, bias, n, int8_activations), expected)
        blocked = [cpu_kernels.pack_groups(t) for t in (scale16.float(), mid)]
        assert torch.equal(_linear(bits, x, q, *blocked, bias, n, int8_activations), expected)


def test_pack_w4_layout():
    q = torch.randint(0, 16, (20, 6), dtype=torch.uint8)
    packed = cpu_kernels.pack_w4(q)
    assert packed.shape == (2, 3, 16) and packed.dtype == torch.uint8
    for n in range(20):
        block = packed[n // 16, :, n % 16]
        assert torch.equal(block & 0x0F, q[n, 0::2]) and torch.equal(block >> 4, q[n, 1::2])
    assert not packed[1, :, 4:].any()  # the last block's padding


def test_bad_input_is_refused():
    q = cpu_kernels.pack_w4(torch.randint(0, 16, (32, 8), dtype=torch.uint8))
    x = torch.randn(2, 8)
    ones = torch.ones(32, 2)
    with pytest.raises(RuntimeError, match="pack_w4: weight must be a uint8"):
        cpu_kernels.pack_w4(torch.randn(4, 4))
    with pytest.raises(RuntimeError, match="pack_w4: K = 5 must be even"):
        cpu_kernels.pack_w4(torch.zeros(4, 5, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"linear_w4: scale must be a contiguous float32 or float16 CPU tensor \[32, G\]"):
        cpu_kernels.linear_w4(x, q, torch.ones(32, 2, dtype=torch.bfloat16), None, None, 32)
    with pytest.raises(RuntimeError, match=r"linear_w4: scale's 3 groups must divide K = 8 into groups of an even size"):
        cpu_kernels.linear_w4(x, q, torch.ones(32, 3), torch.ones(32, 3), None, 32)
    with pytest.raises(RuntimeError, match="linear_w4: zero must be"):
        cpu_kernels.linear_w4(x, q, ones, torch.ones(32, 4), None, 32)
    with pytest.raises(RuntimeError, match="linear_w4: N = 40 does not match"):
        cpu_kernels.linear_w4(x, q, torch.ones(40, 2), torch.ones(40, 2), None, 40)
    with pytest.raises(RuntimeError, match=r"linear_w4: x must be .* \[M, 8\]"):
        cpu_kernels.linear_w4(torch.randn(2, 6), q, ones, ones, None, 32)
    with pytest.raises(RuntimeError, match=r"linear_w8g: weight must be a uint8 CPU tensor in pack_w8's layout"):
        cpu_kernels.linear_w8g(x, q.view(torch.int8), ones, ones, None, 32)
    for int8_activations in (False, True):
        with pytest.raises(RuntimeError, match=r"linear_w4: x has 17 rows; this kernel takes at most 16 \(more rows: linear_dequant\)"):
            cpu_kernels.linear_w4(torch.randn(cpu_kernels.FEW_ROWS_MAX + 1, 8), q, ones, ones, None, 32, int8_activations)


# --- int8 activations (int8_dot.h): x quantized per block of 32 inputs, exact int32 dot products.

# (N, K, group size), groups multiples of 32: odd N, one group per row, 32 and 128.
INT8_SHAPES = [(1, 32, 32), (37, 64, 32), (17, 96, 32), (200, 256, 128), (67, 896, 128), (21, 160, 160)]


def _quantize_x(x: torch.Tensor):
    """llama.cpp's Q8_0 activations as the kernels compute them: per 32 inputs d = max|x| / 127
    (float32), a = round_half_even(x / d) (0 where d = 0). Returns a [M, K] float64 of integers
    and d [M, K / 32] float64."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    a = torch.where(d == 0, torch.zeros_like(xb), torch.round(xb / d).clamp(-127, 127))
    return a.view(m, k).double(), d.squeeze(-1).double()


def _int8_reference(x, q, scale, zero, bias):
    """y = sum_b d_b * s_g * (sum_k a_k Q_k - z_g * sum_k a_k) in float64 (exact integer dots),
    and the magnitude that bounds the kernel's float32 rounding of it."""
    a, d = _quantize_x(x)
    xq = a * d.repeat_interleave(32, dim=1)  # the dequantized int8 x, exact in float64
    w = _dequantize(q, scale, zero)
    exact = xq @ w.T + (0 if bias is None else bias.double())
    group = q.shape[1] // scale.shape[1]
    s = scale.double().repeat_interleave(group, dim=1)
    z = zero.double().repeat_interleave(group, dim=1)
    magnitude = xq.abs() @ (s * (q.double() + z.abs())).T + (0 if bias is None else bias.double().abs())
    return exact, magnitude


@pytest.mark.parametrize("shape,rows,variant", latin_grid(INT8_SHAPES, [1, 2, 3, 4, 7, 16], VARIANTS))  # passes of 4 rows and the 3 / 2 / 1 tails
def test_int8_activations_match_the_same_math_in_float64(shape, rows, variant):
    (n, k, group), (bits, x_dtype) = shape, variant
    q, scale, zero = _random_case(n, k, group, n * 17 + k + rows, bits)
    x = torch.randn(rows, k).to(x_dtype)
    x[0, :32] = 0  # a block of zeros: d = 0
    bias = torch.randn(n) if rows % 2 else None
    got = _linear(bits, x, q, scale, zero, bias, n, True)
    assert got.shape == (rows, n) and got.dtype == x_dtype
    _assert_within_fold_error(got, *_int8_reference(x, q, scale, zero, bias), k, group)


def _assert_within_fold_error(got, exact, magnitude, k: int, group: int):
    # Integer dots are exact; the float32 folds: one per activation block and group, plus the end.
    bound = (k // 32 + k // group + 4) * 2.0**-24 * magnitude
    if got.dtype != torch.float32:
        bound = bound + exact.abs() * torch.finfo(got.dtype).eps
    err = (got.double() - exact).abs()
    assert bool((err <= bound + 1e-30).all()), float((err - bound).max())


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_at_the_extremes(bits):
    # Largest weights against +-127 activations: where vpmaddubsw's int16 pairs could saturate.
    n, k = 16, 64
    q = torch.full((n, k), 2**bits - 1, dtype=torch.uint8)
    q[::2, ::3] = 0
    scale, zero = torch.ones(n, 2), torch.zeros(n, 2)
    zero[1::4] = 2**bits - 1  # dots far from zero once the zero point is taken off
    x = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0).repeat(3, 1)
    x[1] = 1.0
    x[2, 5] = -1.0
    got = _linear(bits, x, q, scale, zero, None, n, True)
    _assert_within_fold_error(got, *_int8_reference(x, q, scale, zero, None), k, 32)


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_stay_within_the_documented_error_of_the_exact_path(bits):
    # |x - x_q| <= d / 2 = max|x_block| / 254 per input, so |y_int8 - y| <= sum_k that * |W[n, k]|.
    n, k, group = 67, 896, 32
    q, scale, zero = _random_case(n, k, group, 5, bits)
    x = torch.randn(2, k)
    w = _dequantize(q, scale, zero)
    got = _linear(bits, x, q, scale, zero, None, n, True).double()
    exact = x.double() @ w.T
    half_step = (x.view(2, -1, 32).abs().amax(-1) / 254).repeat_interleave(32, dim=1).double()
    bound = half_step @ w.abs().T * (1 + 1e-5) + 1e-6 * (x.double().abs() @ w.abs().T)
    assert bool(((got - exact).abs() <= bound).all())
    assert float((got - exact).abs().max()) > 0  # activations were quantized


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group,rows", [(130, 8, 8, 2), (20, 48, 16, 1)])
def test_int8_activations_fall_back_to_the_exact_path(bits, n, k, group, rows):
    # Groups that are not whole blocks of 32 keep float32 activations.
    q, scale, zero = _random_case(n, k, group, 3, bits)
    x = torch.randn(rows, k)
    assert torch.equal(_linear(bits, x, q, scale, zero, None, n, True), _linear(bits, x, q, scale, zero, None, n))

