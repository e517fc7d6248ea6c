"""``linear_dequant`` (many rows against 8- / 4-bit weights, dequantized tile by tile into a
GEMM) equals the float64 product of the weights it dequantizes, at every instruction-set level
the host supports: in float32 ((Q - zero) * scale, as PyTorch computes it) for the float32
GEMM, rounded to bfloat16 for the bfloat16 GEMM (x bfloat16 on an AVX512-BF16 build), within
float32 summation error plus the output's rounding; for each weight format, ragged shapes,
group boundaries, several tiles with a ragged last one, with or without bias. A oneDNN-packed
int8 weight takes the int8-activation road: x quantized per row, then an exact int8 GEMM (run
only where ``onednn_int8_gemm_exact()``, the engine's own choice of that road, holds).
Grouped weights stored compactly (float16 scales, no zero points for symmetric ones, scales in
``pack_groups``' blocks) give what the float32 [N, G] scales and zero points of the same values
give. Bad input is refused with a clear
error."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.quantization.int8 import onednn_int8_gemm_exact

pytestmark = pytest.mark.usefixtures("isa_kernel")

# (N, K, group size): odd N, one group per row, groups of 2, 32 and 128, the 0.5B shape's K.
SHAPES = [(1, 2, 2), (37, 64, 32), (130, 8, 8), (67, 896, 128), (45, 256, 256), (17, 96, 32)]
FORMATS = ["int8", "fp8", "uint8 groups", "uint4 groups"]


def _case(fmt: str, n: int, k: int, group: int, seed: int):
    """(weight as linear_dequant takes it, scale, zero or None, bits, float32 dequantized W [n, k])."""
    gen = torch.Generator().manual_seed(seed)
    if fmt in ("int8", "fp8"):
        scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
        if fmt == "int8":
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
            return cpu_kernels.pack_w8(q), scale, None, 8, q.float() * scale[:, None]
        f = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn)
        packed = cpu_kernels.pack_w8(f.view(torch.int8)).view(torch.float8_e4m3fn)
        return packed, scale, None, 8, f.float() * scale[:, None]
    bits = 8 if fmt == "uint8 groups" else 4
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-4
    zero = torch.randint(0, 2**bits, (n, k // group), generator=gen).float()
    w = (q.float() - zero.repeat_interleave(group, dim=1)) * scale.repeat_interleave(group, dim=1)
    packed = cpu_kernels.pack_w4(q) if bits == 4 else cpu_kernels.pack_w8(q.view(torch.int8)).view(torch.uint8)
    return packed, scale, zero, bits, w


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("rows,tile_cols", [(1, 0), (17, 16), (40, 32), (64, 0)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64_product(fmt, n, k, group, rows, tile_cols, x_dtype):
    packed, scale, zero, bits, w32 = _case(fmt, n, k, group, n * 31 + k + rows)
    x = torch.randn(rows, k).to(x_dtype)
    bias = torch.randn(n) if rows % 2 else None
    got = cpu_kernels.linear_dequant(x, packed, scale, zero, bias, n, bits, tile_cols)
    assert got.shape == (rows, n) and got.dtype == x_dtype
    bf16_gemm = x_dtype == torch.bfloat16 and cpu_kernels.build_info().startswith("avx512_bf16")
    gemm_dtype = torch.bfloat16 if bf16_gemm else torch.float32
    w = w32.to(gemm_dtype).double()
    b = 0 if bias is None else bias.to(gemm_dtype).double()
    exact = x.double() @ w.T + b
    magnitude = x.double().abs() @ w.abs().T + (0 if bias is None else abs(b))
    bound = (k + 4) * 2.0**-24 * magnitude
    if x_dtype != torch.float32:  # the output's rounding, subnormals included
        info = torch.finfo(x_dtype)
        bound = bound + exact.abs() * info.eps + info.smallest_normal * info.eps
    err = (got.double() - exact).abs()
    assert bool((err <= bound + 1e-30).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("bits,n,k,group", [(4, 37, 64, 32), (8, 17, 96, 32), (4, 67, 896, 128), (4, 1, 2, 2)])
def test_float16_scales_and_symmetric_weights_equal_their_float32_form(bits, n, k, group):
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scale16 = (torch.rand(n, k // group, generator=gen) * 0.01 + 1e-4).half()
    mid = torch.full(scale16.shape, float(2 ** (bits - 1)))
    packed = cpu_kernels.pack_w4(q) if bits == 4 else cpu_kernels.pack_w8(q.view(torch.int8)).view(torch.uint8)
    for x_dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(20, k).to(x_dtype)
        expected = cpu_kernels.linear_dequant(x, packed, scale16.float(), mid, None, n, bits, 16)
        assert torch.equal(cpu_kernels.linear_dequant(x, packed, scale16, None, None, n, bits, 16), expected)
        assert torch.equal(cpu_kernels.linear_dequant(x, packed, scale16, mid, None, n, bits, 16), expected)
        blocked = cpu_kernels.pack_groups(scale16), cpu_kernels.pack_groups(mid)
        assert torch.equal(cpu_kernels.linear_dequant(x, packed, *blocked, None, n, bits, 16), expected)
        assert torch.equal(cpu_kernels.linear_dequant(x, packed, blocked[0], None, None, n, bits, 16), expected)


def test_bfloat16_gemm_on_avx512_bf16_builds():
    """On an AVX512-BF16 build a bfloat16 x multiplies bfloat16-rounded weights (the GEMM a bf16
    layer runs); elsewhere float32 ones: two groups whose scales differ by less than bfloat16
    holds, and cancel there, tell them apart."""
    q = torch.tensor([[2, 2, 0, 0]], dtype=torch.uint8).expand(16, 4).contiguous()
    zero = torch.ones(16, 2)
    scale = torch.tensor([[1 + 2.0**-9, 1.0]]).expand(16, 2).contiguous()  # 1 + 2^-9 is 1 in bfloat16
    packed = cpu_kernels.pack_w8(q.view(torch.int8)).view(torch.uint8)
    x = torch.ones(32, 4, dtype=torch.bfloat16)
    y = cpu_kernels.linear_dequant(x, packed, scale, zero, None, 16, 8)
    expected = 0.0 if cpu_kernels.build_info().startswith("avx512_bf16") else 2.0**-8
    assert torch.equal(y.float(), torch.full((32, 16), expected))


@pytest.mark.skipif(
    not onednn_int8_gemm_exact(),
    reason="the engine packs int8 weights for oneDNN only where its int8 GEMMs are exact (VNNI); they saturate here",
)
@pytest.mark.parametrize("n,k,rows", [(1, 2, 1), (37, 64, 300), (67, 896, 3), (130, 8, 17)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_onednn_packed_int8_quantizes_x_per_row(n, k, rows, x_dtype):
    """y = (a Q^T) * scale[n] * s[m] + b with a = round_half_even(x / s), s = max|x_row| / 127
    (torch's float32 arithmetic, the same operations), the int sums exact: within three float32
    roundings and the output's; an all-zero row gives the bias; 300 rows take two oneDNN calls."""
    gen = torch.Generator().manual_seed(n * 31 + k + rows)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    x = (torch.randn(rows, k, generator=gen) * 3).to(x_dtype)
    x[0] = 0
    bias = torch.randn(n, generator=gen) if rows % 2 else None
    packed = torch.ops.onednn.qlinear_prepack(q, None)
    got = cpu_kernels.linear_dequant(x, packed, scale, None, bias, n, 8)
    assert got.shape == (rows, n) and got.dtype == x_dtype
    xf = x.float()
    s = xf.abs().amax(dim=1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    a = torch.round(xf / s)
    assert a.abs().max() <= 127
    product = (a.double() @ q.double().T) * scale.double() * s.double()
    b = 0 if bias is None else bias.double()
    exact = product + b
    bound = 4 * 2.0**-24 * (product.abs() + abs(b))
    if x_dtype != torch.float32:
        info = torch.finfo(x_dtype)
        bound = bound + exact.abs() * info.eps + info.smallest_normal * info.eps
    err = (got.double() - exact).abs()
    assert bool((err <= bound + 1e-30).all()), f"max excess {(err - bound).max().item():.3g}"


def test_inference_mode_holds_in_the_worker_threads():
    """Under InferenceMode (as the engine runs) y is an inference tensor that the tiles' worker
    threads write into: they must see the mode too."""
    q = torch.randint(-127, 128, (64, 32), dtype=torch.int8)
    scale, packed = torch.rand(64), cpu_kernels.pack_w8(q)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            x = torch.randn(20, 32)
            y = cpu_kernels.linear_dequant(x, packed, scale, None, torch.randn(64), 64, 8, 16)
    finally:
        torch.set_num_threads(threads)
    assert y.shape == (20, 64) and y.is_inference()


def test_bad_input_is_refused():
    q = torch.zeros(32, 64, dtype=torch.int8)
    packed, scale, x = cpu_kernels.pack_w8(q), torch.ones(32), torch.zeros(20, 64)
    with pytest.raises(RuntimeError, match="tile_cols must be 0 or a multiple of 16"):
        cpu_kernels.linear_dequant(x, packed, scale, None, None, 32, 8, 24)
    with pytest.raises(RuntimeError, match="N = 40 does not match"):
        cpu_kernels.linear_dequant(x, packed, scale.new_ones(40), None, None, 40, 8)
    with pytest.raises(RuntimeError, match="weight must be uint8 .* or int8 / float8_e4m3fn with per-output scales and no zero"):
        cpu_kernels.linear_dequant(x, packed, scale[:, None], scale[:, None], None, 32, 8)
    with pytest.raises(RuntimeError, match="scale must be a contiguous float32"):
        cpu_kernels.linear_dequant(x, packed, scale[:16], None, None, 32, 8)
    with pytest.raises(RuntimeError, match=r"x must be a float32 / bfloat16 / float16 CPU tensor \[M, 64\]"):
        cpu_kernels.linear_dequant(torch.zeros(20, 63), packed, scale, None, None, 32, 8)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        cpu_kernels.linear_dequant(x, packed, scale, None, None, 32, 3)
    onednn = torch.ops.onednn.qlinear_prepack(q, None)
    with pytest.raises(RuntimeError, match=r"oneDNN-packed weight must be int8 \[K, N\].*N = 40"):
        cpu_kernels.linear_dequant(x, onednn, scale, None, None, 40, 8)
