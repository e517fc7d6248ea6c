"""``linear_w16`` (16-bit weights in ``pack_w16``'s blocks, widened to float32 in the kernel)
equals the float64 product within float32 summation error (float32 out) or one rounding
(16-bit out), at every instruction-set level the host supports, on both of its paths (the
few-row streaming kernel and the widening GEMM), ragged shapes, strided inputs and bias
dtypes; layers whose weights oneDNN cannot pack use it, with a float32 copy for many rows;
bad input is refused with a clear error. ``linear_rows`` (``--batch-invariant``) gives every
row the same bits whatever the rows around it and their number, within the same bound."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers import cpu_gemm
from pagedllm.model_executor.layers import linear as linear_mod
from tests.grids import latin_grid

pytestmark = pytest.mark.usefixtures("isa_kernel")

# (N, K): ragged N (not a multiple of the 2 / 4 output rows a tile takes, nor of the 64-row
# chunks), K below, between and above multiples of 8 (the vector width), a model's K.
SHAPES = [(1, 1), (37, 33), (130, 7), (200, 96), (67, 896), (90, 4864)]
ROWS = [1, 2, 3, 5, 16, 17]  # tiles of 4, 3, 2 and 1 rows; the GEMM
# (weight dtype, x dtype): each of the kernel's (weight, output) instantiations, for every row
# tiling and every shape (latin_grid).
DTYPES = [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
          (torch.float16, torch.float32)]


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    k = x.shape[1]
    # float32 sums of exact products (16-bit x 16-bit and float32 x 16-bit products of
    # float32-representable values are exact in float64; the float32 product rounds once):
    # |error| <= (k + 1) u sum|x_i w_i| (Higham 3.5), u = 2^-24.
    magnitude = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = (k + 2) * 2.0**-24 * magnitude
    if got.dtype != torch.float32:  # then one rounding to the output dtype
        bound = bound + exact.abs() * torch.finfo(got.dtype).eps
    err = (got.double() - exact).abs()
    assert bool((err <= bound + 1e-30).all()), float((err - bound).max())


@pytest.mark.parametrize("shape,rows,dtypes", latin_grid(SHAPES, ROWS, DTYPES))
def test_matches_float64_product(shape, rows, dtypes):
    (n, k), (w_dtype, x_dtype) = shape, dtypes
    torch.manual_seed(n * 31 + k + rows)
    w = torch.randn(n, k).to(w_dtype)
    x = torch.randn(rows, k).to(x_dtype)
    bias = torch.randn(n) if rows % 2 else None
    got = cpu_kernels.linear_w16(x, cpu_kernels.pack_w16(w), bias, n)
    assert got.shape == (rows, n) and got.dtype == x_dtype
    _check(got, x, w, bias)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bias_dtypes_and_float16_out(bias_dtype):
    torch.manual_seed(0)
    w = torch.randn(70, 40).to(torch.bfloat16)
    x = torch.randn(3, 40).to(torch.float16)
    bias = torch.randn(70).to(bias_dtype)
    got = cpu_kernels.linear_w16(x, cpu_kernels.pack_w16(w), bias, 70)
    assert got.dtype == torch.float16
    _check(got, x, w, bias)


def test_pack_layout():
    """Element (n, k) of W at [n // 16, k, n % 16]; the last block's padding is zero."""
    w = torch.randn(37, 5).to(torch.bfloat16)
    packed = cpu_kernels.pack_w16(w)
    assert packed.shape == (3, 5, 16) and packed.dtype == torch.bfloat16
    n, k = torch.meshgrid(torch.arange(37), torch.arange(5), indexing="ij")
    assert torch.equal(packed[n // 16, k, n % 16], w)
    assert not packed[2, :, 5:].any()
    assert torch.equal(cpu_kernels.pack_w16(w.T.contiguous().T), packed)  # any strides in


def test_strided_inputs_equal_contiguous():
    torch.manual_seed(0)
    w = cpu_kernels.pack_w16(torch.randn(100, 40).to(torch.bfloat16))
    wide = torch.randn(6, 63)
    for x in (wide[:, 3:43], wide[::2, :40], torch.randn(40, 5).T):
        expected = cpu_kernels.linear_w16(x.contiguous(), w, None, 100)
        assert torch.equal(cpu_kernels.linear_w16(x, w, None, 100), expected)


def test_bad_input_is_refused():
    w = cpu_kernels.pack_w16(torch.randn(64, 32).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        cpu_kernels.pack_w16(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="packed by pack_w16"):
        cpu_kernels.linear_w16(torch.randn(1, 32), torch.randn(64, 32).to(torch.bfloat16), None, 64)
    with pytest.raises(RuntimeError, match="does not match the packed weight's 4 blocks"):
        cpu_kernels.linear_w16(torch.randn(1, 32), w, None, 65)
    with pytest.raises(RuntimeError, match=r"\[M, 32\]"):
        cpu_kernels.linear_w16(torch.randn(1, 31), w, None, 64)
    with pytest.raises(RuntimeError, match=r"\[M, 32\]"):
        cpu_kernels.linear_w16(torch.randn(1, 32, dtype=torch.float64), w, None, 64)
    with pytest.raises(RuntimeError, match=r"bias must be \[64\]"):
        cpu_kernels.linear_w16(torch.randn(1, 32), w, torch.zeros(63), 64)
    with pytest.raises(ValueError, match="needs out_features"):
        cpu_gemm.linear(torch.randn(1, 32), w)


def test_linear_routes_packed_16bit_weights_to_it(monkeypatch):
    """``pack_w16`` weights go through ``linear_w16`` for every row count and for 3-D inputs."""
    calls = []
    real = cpu_kernels.linear_w16
    monkeypatch.setattr(cpu_kernels, "linear_w16", lambda *a: calls.append(a[0].shape) or real(*a))
    torch.manual_seed(1)
    w = torch.randn(24, 16).to(torch.bfloat16)
    packed = cpu_kernels.pack_w16(w)
    for shape in ((1, 16), (40, 16), (2, 3, 16)):
        x = torch.randn(shape).to(torch.bfloat16)
        out = cpu_gemm.linear(x, packed, out_features=24)
        assert out.shape == (*shape[:-1], 24)
        torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=2**-8, atol=1e-2)
    assert calls == [(1, 16), (40, 16), (6, 16)]


def _fp16_layer(bias: bool = True) -> linear_mod.ReplicatedLinear:
    torch.manual_seed(2)
    layer = linear_mod.ReplicatedLinear(40, 24, bias=bias).to(torch.float16)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    return layer


def test_layer_multiplies_many_rows_by_its_float32_copy(monkeypatch):
    """A widened 16-bit layer keeps a float32 copy (``auto``, memory permitting): up to 16 rows
    go through ``linear_w16`` on the 16-bit weight, more through the copy; same products."""
    monkeypatch.delenv(cpu_gemm.FP32_COPY_ENV, raising=False)
    monkeypatch.setattr(cpu_gemm, "_fp32_copy_budget", None)
    layer = _fp16_layer()
    weight = layer.weight.data.clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.shape == (2, 40, 16) and layer.weight.dtype == torch.float16 and not layer.weight.is_mkldnn
    assert layer.weight_fp32 is not None
    assert layer.weight_fp32.dtype == torch.float32 and layer.weight_fp32.shape == (24, 40)
    assert layer.quant_method.describe_path(layer).endswith("(linear_w16) (> 16 rows: float32 copy)")
    calls = []
    real = cpu_kernels.linear_w16
    monkeypatch.setattr(cpu_kernels, "linear_w16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 16, 17, 64):
        x = torch.randn(rows, 40).to(torch.float16)
        out = layer(x)
        assert out.dtype == torch.float16
        _check(out, x, weight, layer.bias.data)
    assert calls == [1, 16]


def test_float32_copy_modes(monkeypatch):
    weight = torch.randn(24, 40).to(torch.bfloat16)
    monkeypatch.setenv(cpu_gemm.FP32_COPY_ENV, "0")
    assert cpu_gemm.fp32_weight_copy(weight) is None
    monkeypatch.setenv(cpu_gemm.FP32_COPY_ENV, "auto")
    monkeypatch.setattr(cpu_gemm, "_fp32_copy_budget", 24 * 40 * 4 - 1)  # one byte short
    assert cpu_gemm.fp32_weight_copy(weight) is None
    assert cpu_gemm._fp32_copy_budget == 24 * 40 * 4 - 1
    monkeypatch.setattr(cpu_gemm, "_fp32_copy_budget", 24 * 40 * 4)
    assert torch.equal(cpu_gemm.fp32_weight_copy(weight), weight.float())
    assert cpu_gemm._fp32_copy_budget == 0
    monkeypatch.setenv(cpu_gemm.FP32_COPY_ENV, "1")  # whatever the budget
    assert cpu_gemm.fp32_weight_copy(weight) is not None
    monkeypatch.setenv(cpu_gemm.FP32_COPY_ENV, "yes")
    with pytest.raises(ValueError, match="use auto, 0 or 1"):
        cpu_gemm.fp32_weight_copy(weight)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,k", [(37, 33), (67, 896), (1, 1)])
def test_linear_rows_same_bits_for_a_row_whatever_the_batch(isa_kernel, w_dtype, x_dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(w_dtype)
    packed = isa_kernel.pack_w32(w) if w_dtype == torch.float32 else isa_kernel.pack_w16(w)
    x = torch.randn(41, k, generator=gen).to(x_dtype)
    bias = torch.randn(n, generator=gen)
    full = isa_kernel.linear_rows(x, packed, bias, n)
    assert full.shape == (41, n) and full.dtype == x_dtype
    _check(full, x, w, bias)
    for start, rows in [(0, 1), (3, 2), (5, 3), (7, 4), (11, 5), (16, 17), (40, 1)]:
        assert torch.equal(isa_kernel.linear_rows(x[start : start + rows], packed, bias, n), full[start : start + rows])
    other = torch.cat([x[:1], torch.randn(6, k, generator=gen).to(x_dtype)])  # row 0 beside other rows
    assert torch.equal(isa_kernel.linear_rows(other, packed, bias, n)[0], full[0])


def test_linear_rows_rejects_bad_inputs(isa_kernel):
    packed = isa_kernel.pack_w16(torch.randn(20, 8).bfloat16())
    with pytest.raises(RuntimeError, match="linear_rows: x must be"):
        isa_kernel.linear_rows(torch.randn(2, 9), packed, None, 20)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        isa_kernel.linear_rows(torch.randn(2, 8), packed, None, 40)
    with pytest.raises(RuntimeError, match="pack_w32: weight must be a float32"):
        isa_kernel.pack_w32(torch.randn(4, 4).bfloat16())
