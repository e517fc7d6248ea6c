"""GEMM plans: each linear layer's matmul, chosen once when its weights are loaded.

A plan is called as ``plan(x, bias)``: x [..., in] (the layer's input dtype) and bias [out]
or None -> [..., out] in x's dtype, y = x W^T + b. ``plan.describe()`` names it in the
start-up log. Which plan a layer gets, and the weight layout it needs, is decided here:

- ``TorchGemm``: torch's matmul on the plain weight (off CPU, or no faster path);
- ``OneDnnGemm``: oneDNN's pre-packed layout (``can_pack``), with bf16 inputs of at most
  ``SMALL_M_ROWS`` rows on ``pagedllm.kernels.cpu.packed_linear`` where the layout was checked;
- ``WidenedGemm``: 16-bit weights oneDNN cannot pack, ``pack_w16``'s layout for ``linear_w16``
  (widened to float32 in-kernel), with a float32 copy for many rows (``fp32_weight_copy``);
- ``Scaled8BitGemm`` / ``OneDnnInt8Gemm`` / ``GroupedGemm``: the quantized layouts' kernels,
  few rows and many (``DEQUANT_GEMM_MIN_ROWS``), and their torch fallbacks.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels import isa
from pagedllm.platforms import current_platform

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

# Rows up to which ``OneDnnGemm`` uses the packed-weight streaming kernel rather than oneDNN's
# matmul (it was faster at every count from 1 to 16 on a 2-core Zen 4 and, with AMX tiles,
# on a 2-core Xeon; see packed_linear.cpp). An AMX tile holds 16 rows.
SMALL_M_ROWS = 16

# [out, in] shapes whose oneDNN-packed bf16 layout ``packed_linear`` was checked to read
# correctly (``_check_packed_linear``) -> (the layout's outputs per block: 64, or 32 where
# oneDNN uses AMX; whether the kernel uses AMX tiles), and the shapes found not to.
_packed_linear_shapes: dict[tuple[int, int], tuple[int, bool]] = {}
_packed_linear_rejected: set[tuple[int, int]] = set()
_check_lock = threading.Lock()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([out, in], a CPU tensor) can use oneDNN's pre-packed matmul here:
    torch built with oneDNN, float32 or bfloat16 (bf16 only with native bf16: the
    avx512_bf16 level, and oneDNN supporting it), and ``PAGEDLLM_DISABLE_CPU_KERNELS`` unset.

    Raises:
        ValueError: an invalid ``PAGEDLLM_CPU_ISA``.
    """
    if weight.dim() != 2 or weight.dtype not in _PACKABLE_DTYPES:
        return False
    if envs.PAGEDLLM_DISABLE_CPU_KERNELS.get():
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    # oneDNN also "supports" bf16 on AVX-512 without BF16, by emulation: slower there than
    # linear_w16 (tiny bf16 model, 16 x 120/64: 1,617 vs 2,431 tok/s under PAGEDLLM_CPU_ISA).
    return weight.dtype != torch.bfloat16 or (
        isa.selected_isa() == "avx512_bf16" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] re-laid out for ``torch.ops.mkldnn._linear_pointwise``: a new
    tensor of the same shape and dtype in the ``torch._mkldnn`` layout (wrap it in a new
    ``nn.Parameter``; it cannot become a strided parameter's ``.data``). Call only when
    ``can_pack(weight)``."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    if packed.dtype == torch.bfloat16:
        _check_packed_linear(packed.shape[0], packed.shape[1])
    return packed


def _check_packed_linear(n: int, k: int) -> None:
    """Decide, once per [n, k] shape, whether ``OneDnnGemm`` may send few-row inputs to
    ``packed_linear``, with which block and whether with AMX tiles: the kernels must be built
    with AVX512-BF16, and the kernel's product with a random weight packed by oneDNN here
    must match oneDNN's matmul for one of the block widths it reads (64 outputs; 32 where
    oneDNN uses AMX). A different blocking would not match. 32-output blocks use AMX tiles
    where ``has_amx()`` and their product matches too. The probe has the shape's K and at
    most 1024 + n % 64 rows: oneDNN blocks N by 32 or 64 from 64 outputs up, so more rows
    only repeat the same blocks (and the kernel checks each weight's byte size)."""
    shape = (n, k)
    with _check_lock:
        if shape in _packed_linear_shapes or shape in _packed_linear_rejected:
            return
        if cpu_kernels.has_packed_linear():
            generator = torch.Generator().manual_seed(0)
            rows = n if n <= 1024 else 1024 + n % 64
            probe = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(probe, None)
            x = torch.randn(3, k, generator=generator).to(torch.bfloat16)
            expected = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()
            for block_n in (64, 32):
                try:
                    got = cpu_kernels.packed_linear(x, packed, None, block_n)
                except RuntimeError:
                    continue
                if _same_product(got, expected):
                    amx = block_n == 32 and cpu_kernels.has_amx()
                    amx = amx and _same_product(cpu_kernels.packed_linear(x, packed, None, block_n, True), expected)
                    _packed_linear_shapes[shape] = (block_n, amx)
                    return
        _packed_linear_rejected.add(shape)


def _same_product(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether two bf16 products of the same operands agree: float32 sums of the same
    products, each rounded once to bf16, may differ only in summation order."""
    got = got.float()
    return torch.allclose(got, expected, rtol=2**-7, atol=1e-2 * float(expected.abs().max()))


def packed_linear_reads(n: int, k: int) -> bool:
    """Whether ``OneDnnGemm`` sends few-row bf16 inputs of a packed [n, k] weight to
    ``packed_linear`` here (checking the shape first if needed): False where the kernels lack
    AVX512-BF16, or where oneDNN packs bf16 weights in a layout the kernel does not read."""
    _check_packed_linear(n, k)
    return (n, k) in _packed_linear_shapes


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, out_features: Optional[int] = None
) -> torch.Tensor:
    """y = x W^T + b for x [..., in] and W [out, in] (plain, ``pack_weight``'s output, or
    ``pack_w16``'s [ceil(out / 16), in, 16], which needs ``out_features``) -> [..., out], x's
    dtype: the plan of ``weight``'s layout, made for this call (layers keep theirs).

    Raises:
        ValueError: a ``pack_w16`` weight without ``out_features``.
    """
    if weight.is_mkldnn:
        return OneDnnGemm(weight)(x, bias)
    if weight.dim() == 3:
        if out_features is None:
            raise ValueError("linear: a pack_w16 weight needs out_features")
        return WidenedGemm(weight, out_features, None)(x, bias)
    return F.linear(x, weight, bias)


_WIDENED_DTYPES = (torch.bfloat16, torch.float16)


def should_widen(weight: torch.Tensor) -> bool:
    """Whether a loaded plain CPU weight [out, in] is to be multiplied by ``linear_w16``:
    16-bit, oneDNN cannot pack it here (``can_pack``), and the kernels are available."""
    return (
        not weight.is_mkldnn
        and weight.dim() == 2
        and weight.dtype in _WIDENED_DTYPES
        and not can_pack(weight)
        and _kernels_available()
    )


def _kernels_available() -> bool:
    return cpu_kernels.is_available()


def pack_w16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in ``linear_w16``'s blocked layout (see
    ``pagedllm.kernels.cpu.pack_w16``). Call only when ``should_widen(weight)``."""
    return cpu_kernels.pack_w16(weight)


#: ``auto`` (default): float32 copies of widened 16-bit weights while they fit in a quarter of
#: the memory available when the first is made; ``1``: always; ``0``: never.
FP32_COPY_ENV = envs.PAGEDLLM_CPU_FP32_WEIGHT_COPY.name
_FP32_COPY_SHARE = 0.25
_fp32_copy_budget: Optional[int] = None  # bytes left for copies under "auto"


def fp32_weight_copy(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """A float32 copy of a 16-bit weight [out, in], plain, for
    matmuls of more than ``SMALL_M_ROWS`` rows, or None where ``PAGEDLLM_CPU_FP32_WEIGHT_COPY``
    does not allow it (``auto``: while the copies fit in a quarter of the memory available
    when the first is made).

    Why: above 16 rows the matmul is compute-bound, and ``linear_w16`` widening the weights
    chunk by chunk for torch's float32 GEMM was 8-27% slower than a float32 weight (0.5B-shape
    layers, 128 to 32 rows, AVX2 build under ``PAGEDLLM_CPU_ISA=avx2``); decode steps of up to
    16 rows keep streaming the 16-bit weight (half the bytes). The copy costs twice the 16-bit
    weight's memory, counted in the weight memory that sizes the KV cache.

    Raises:
        ValueError: for a value of the variable other than auto / 0 / 1.
    """
    global _fp32_copy_budget
    mode = envs.PAGEDLLM_CPU_FP32_WEIGHT_COPY.get()
    if mode == "0":
        return None
    nbytes = weight.numel() * 4
    if mode == "auto":
        if _fp32_copy_budget is None:
            _fp32_copy_budget = int(current_platform.total_memory_bytes() * _FP32_COPY_SHARE)
        if nbytes > _fp32_copy_budget:
            return None
        _fp32_copy_budget -= nbytes
    # Plain, not oneDNN-packed: as fast for these row counts (128 rows, 0.5B-shape layers:
    # 0.195-0.201 s either way) and 0.7 s less start-up for the 0.5B shape.
    copy = _fp32_arena_take(weight.numel()).view(weight.shape)
    copy.copy_(weight)
    return copy


_FP32_ARENA_BYTES = 256 << 20
_fp32_arena: Optional[torch.Tensor] = None  # float32 storage the copies are carved from
_fp32_arena_used = 0  # elements of it taken


@contextmanager
def separate_fp32_copies() -> Iterator[None]:
    """The float32 copies made inside come from arenas of their own and from a budget measured
    afresh; those made before are untouched (sleep mode's level 2 loads a model again, copies
    its weights into the sleeping one's, then drops it: its copies go with it)."""
    global _fp32_arena, _fp32_arena_used, _fp32_copy_budget
    saved = _fp32_arena, _fp32_arena_used, _fp32_copy_budget
    _fp32_arena, _fp32_arena_used, _fp32_copy_budget = None, 0, None
    try:
        yield
    finally:
        _fp32_arena, _fp32_arena_used, _fp32_copy_budget = saved


def _fp32_arena_take(numel: int) -> torch.Tensor:
    """``numel`` fresh float32 elements for a weight copy, carved from 256 MB arenas: one
    allocation per arena instead of one per layer faulted its pages in twice as fast (0.39 vs
    0.81 s for the 0.5B shape's 1.4 GB of copies). Pages never touched cost no memory."""
    global _fp32_arena, _fp32_arena_used
    if _fp32_arena is None or _fp32_arena_used + numel > _fp32_arena.numel():
        _fp32_arena = torch.empty(max(_FP32_ARENA_BYTES // 4, numel), dtype=torch.float32)
        _fp32_arena_used = 0
    out = _fp32_arena[_fp32_arena_used : _fp32_arena_used + numel]
    _fp32_arena_used += numel
    return out


#: Weight bits -> rows of x from which the quantized plans call ``linear_dequant`` instead of
#: the few-row kernels (``linear_w8``, ``linear_w8g`` and ``linear_fp8`` for 8 bits,
#: ``linear_w4`` for 4); at most ``cpu_kernels.FEW_ROWS_MAX + 1`` (the few-row kernels'
#: limit), the row count from which ``linear_dequant`` was measured faster.
DEQUANT_GEMM_MIN_ROWS = {8: 17, 4: 17}


def _dtype_name(weight: torch.Tensor) -> str:
    return str(weight.dtype).removeprefix("torch.")


class TorchGemm:
    """torch's matmul on ``layer.weight`` [out, in] as it is at each call (tied or replaced
    weights included): a layer's plan until its weights are prepared, and after, where no
    other plan applies."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, self.layer.weight, bias)

    def describe(self) -> str:
        return f"torch {_dtype_name(self.layer.weight)} matmul"


class OneDnnGemm:
    """oneDNN's matmul on a ``pack_weight`` weight; bf16 x of at most ``SMALL_M_ROWS`` rows
    (2-D) go to ``packed_linear`` where ``_packed_linear_shapes`` has the weight's shape (its
    block width and AMX choice, read per call: benchmarks switch AMX at run time)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.shape = tuple(weight.shape)
        self.few_rows = weight.dtype == torch.bfloat16

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.few_rows and x.dim() == 2 and x.shape[0] <= SMALL_M_ROWS and x.dtype == torch.bfloat16:
            kernel = _packed_linear_shapes.get(self.shape)
            if kernel is not None:
                return cpu_kernels.packed_linear(x, self.weight, bias, *kernel)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")

    def describe(self) -> str:
        kernel = _packed_linear_shapes.get(self.shape)
        tiles = ", AMX tiles" if kernel is not None and kernel[1] else ""
        few_rows = f" (1-{SMALL_M_ROWS} rows: packed_linear{tiles})" if kernel is not None else ""
        return f"oneDNN-packed {_dtype_name(self.weight)}{few_rows}"


class WidenedGemm:
    """``linear_w16`` on a ``pack_w16`` weight for W [n, in]; with ``weight_fp32`` (a plain
    float32 copy of W, or None), x of more than ``SMALL_M_ROWS`` rows go to torch's float32
    matmul on it instead."""

    def __init__(self, weight: torch.Tensor, n: int, weight_fp32: Optional[torch.Tensor]) -> None:
        self.weight, self.n, self.weight_fp32 = weight, n, weight_fp32

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.weight_fp32 is not None and x.numel() > SMALL_M_ROWS * x.shape[-1]:
            return F.linear(x.float(), self.weight_fp32, None if bias is None else bias.float()).to(x.dtype)
        y = cpu_kernels.linear_w16(x.reshape(-1, x.shape[-1]), self.weight, bias, self.n)
        return y.view(*x.shape[:-1], self.n)

    def describe(self) -> str:
        copy = f" (> {SMALL_M_ROWS} rows: float32 copy)" if self.weight_fp32 is not None else ""
        return f"{_dtype_name(self.weight)} widened to float32 in-kernel (linear_w16){copy}"


def plan_unquantized(layer: nn.Module, float32_copy: bool) -> TorchGemm | OneDnnGemm | WidenedGemm:
    """Re-lay out a loaded CPU ``layer.weight`` [out, in] for its fastest matmul here and
    return the plan: ``OneDnnGemm`` where ``can_pack``, else ``WidenedGemm`` where
    ``should_widen`` (with ``layer.weight_fp32`` set by ``fp32_weight_copy`` if
    ``float32_copy``), else ``TorchGemm``."""
    weight = layer.weight.data
    if can_pack(weight):
        layer.weight = nn.Parameter(pack_weight(weight), requires_grad=False)
        return OneDnnGemm(layer.weight)
    if should_widen(weight):
        if float32_copy:
            layer.weight_fp32 = fp32_weight_copy(weight)
        layer.weight = nn.Parameter(pack_w16(weight), requires_grad=False)
        return WidenedGemm(layer.weight, layer.output_size_per_partition, layer.weight_fp32)
    return TorchGemm(layer)


class Scaled8BitGemm:
    """8-bit weights F [n, in] in ``pack_w8``'s layout with one float32 scale per output
    (W = scale[:, None] * F): ``kernel`` (``linear_w8`` for int8, ``linear_fp8`` for
    float8_e4m3fn) below ``DEQUANT_GEMM_MIN_ROWS[8]`` rows, ``linear_dequant`` from there."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, n: int, kernel: Callable[..., torch.Tensor]) -> None:
        self.weight, self.scale, self.n, self.kernel = weight, scale, n, kernel

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] >= DEQUANT_GEMM_MIN_ROWS[8]:
            y = cpu_kernels.linear_dequant(x2, self.weight, self.scale, None, bias, self.n, 8)
        else:
            y = self.kernel(x2, self.weight, self.scale, bias, self.n)
        return y.view(*x.shape[:-1], self.n)


class OneDnnInt8Gemm:
    """int8 weights in oneDNN's packed int8 layout (``onednn::qlinear_prepack``) with one
    float32 scale per output: every row count through ``linear_dequant``, which quantizes x
    per row for oneDNN's int8 GEMM."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, n: int) -> None:
        self.weight, self.scale, self.n = weight, scale, n

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        y = cpu_kernels.linear_dequant(x.reshape(-1, x.shape[-1]), self.weight, self.scale, None, bias, self.n, 8)
        return y.view(*x.shape[:-1], self.n)


class DequantizedTorchGemm:
    """8-bit weights F [n, in] as they are, one float32 scale per output: torch's matmul on W
    = scale[:, None] * F rebuilt (in x's dtype) at each call."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        self.weight, self.scale = weight, scale

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        weight = self.weight.to(x.dtype) * self.scale[:, None].to(x.dtype)
        return F.linear(x, weight, bias)


class GroupedGemm:
    """4- or 8-bit weights with per-group scales and zero points (W = scale * (Q - zero)
    per group) in the kernels' blocked layouts (``pack_w4`` / ``pack_w8``, ``pack_groups``):
    ``linear_w4`` / ``linear_w8g`` (with int8 activations if ``int8_activations``) below
    ``DEQUANT_GEMM_MIN_ROWS[bits]`` rows, ``linear_dequant`` from there."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], bits: int, n: int,
                 int8_activations: bool) -> None:
        self.weight, self.scale, self.zero, self.bits, self.n = weight, scale, zero, bits, n
        self.int8_activations = int8_activations
        self.min_dequant_rows = DEQUANT_GEMM_MIN_ROWS[bits]
        self.kernel = cpu_kernels.linear_w4 if bits == 4 else cpu_kernels.linear_w8g

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] >= self.min_dequant_rows:
            y = cpu_kernels.linear_dequant(x2, self.weight, self.scale, self.zero, bias, self.n, self.bits)
        else:
            y = self.kernel(x2, self.weight, self.scale, self.zero, bias, self.n, self.int8_activations)
        return y.view(*x.shape[:-1], self.n)


class GroupedTorchGemm:
    """Grouped weights as they are (Q [n, in], scale / zero [n, groups], zero None:
    2^(bits - 1)): torch's matmul on W dequantized at each call."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], bits: int) -> None:
        self.weight, self.scale, self.zero, self.bits = weight, scale, zero, bits

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        group = self.weight.shape[1] // self.scale.shape[1]
        scale = self.scale.float().repeat_interleave(group, dim=1)
        zero = 2 ** (self.bits - 1) if self.zero is None else self.zero.repeat_interleave(group, dim=1)
        return F.linear(x, (scale * (self.weight.float() - zero)).to(x.dtype), bias)
