"""Linear layers whose parameters know how to load themselves from a checkpoint.

Several checkpoint matrices may be fused into one layer (q/k/v into ``qkv_proj``,
gate/up into ``gate_up_proj``); each parameter carries a ``weight_loader`` that copies a
checkpoint tensor into its shard. Output rows of a fused layer are the shards stacked in
order: ``[q | k | v]`` or ``[gate | up]``.

On CPU, once loaded, weights are re-laid out in oneDNN's blocked format for the matmul
(``pack_weight``; ``process_weights_after_loading``). The product is bit-identical in bf16
and equal up to float32 summation order in float32, and much faster for the small row
counts of decode steps, measured on a 2-core AVX-512-BF16 machine (GFLOP/s, 896 -> 9728):
1 row 42 -> 109, 32 rows 231 -> 402, 512 rows 406 -> 417 (``torch.nn.functional.linear``
-> packed). A packed ``weight`` keeps its shape but is an opaque ``torch._mkldnn``
tensor: use it only through ``linear``. ``PAGEDLLM_DISABLE_CPU_KERNELS=1`` keeps the plain layout.

Packed bf16 weights of a shape whose layout ``pack_weight`` has checked (oneDNN blocks them
by 64 outputs on AVX512-BF16 and by 32 where it uses AMX) go, for inputs of
at most ``SMALL_M_ROWS`` rows, through ``pagedllm.kernels.cpu.packed_linear`` instead of
oneDNN's matmul: a weight-streaming kernel that reads the same packed bytes 1.3-1.6x
faster on 1-16 rows (the decode steps of few requests; see ``packed_linear.cpp``).

16-bit weights that oneDNN cannot pack — bfloat16 on CPUs without native bf16 (AVX2, or
AVX-512 without BF16), and float16 — stay 16-bit, re-laid out in blocks of 16 outputs
(``pack_w16``), and go through ``pagedllm.kernels.cpu.linear_w16``, which widens them to
float32 inside the kernel: decode streams half the bytes of float32 weights; inputs of more
than 16 rows use a float32 copy where memory allows (``fp32_weight_copy``), else torch's
float32 GEMM on widened chunks. Without it, torch's bf16 matmul on such CPUs is an emulated
GEMM about 5x slower than float32 (``pagedllm bench roofline``; measured on an AVX2 host,
32 x 128/128: 12.4 vs 61.3 tok/s).
"""

from __future__ import annotations

import os
import threading
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import isa

ShardId = Union[str, int]

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

# Rows up to which ``linear`` uses the packed-weight streaming kernel rather than oneDNN's
# matmul (it was faster at every count from 1 to 16 on a 2-core Zen 4; see packed_linear.cpp).
SMALL_M_ROWS = 16

# [out, in] shapes whose oneDNN-packed bf16 layout ``packed_linear`` was checked to read
# correctly (``_check_packed_linear``) -> the layout's outputs per block (64, or 32 where
# oneDNN uses AMX), and the shapes found not to.
_packed_linear_shapes: dict[tuple[int, int], int] = {}
_packed_linear_rejected: set[tuple[int, int]] = set()
_check_lock = threading.Lock()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([out, in], on CPU) can use oneDNN's pre-packed matmul here:
    torch built with oneDNN, float32 or bfloat16 (bf16 only with native bf16: the
    avx512_bf16 level, and oneDNN supporting it), and ``PAGEDLLM_DISABLE_CPU_KERNELS`` unset.

    Raises:
        ValueError: an invalid ``PAGEDLLM_CPU_ISA``.
    """
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in _PACKABLE_DTYPES:
        return False
    if os.environ.get("PAGEDLLM_DISABLE_CPU_KERNELS", "") not in ("", "0"):
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
    """Decide, once per [n, k] shape, whether ``linear`` may send few-row inputs to
    ``packed_linear``, and with which block: the kernels must be built with AVX512-BF16, and
    the kernel's product with a random weight packed by oneDNN here must match oneDNN's
    matmul for one of the block widths it reads (64 outputs; 32 where oneDNN uses AMX). A
    different blocking would not match. The probe has the shape's K and at most
    1024 + n % 64 rows: oneDNN blocks N by 32 or 64 from 64 outputs up, so more rows only
    repeat the same blocks (and the kernel checks each weight's byte size)."""
    from pagedllm.kernels import cpu as cpu_kernels

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
                    got = cpu_kernels.packed_linear(x, packed, None, block_n).float()
                except RuntimeError:
                    continue
                # Both are float32 sums of the same products, each rounded once to bf16.
                if torch.allclose(got, expected, rtol=2**-7, atol=1e-2 * float(expected.abs().max())):
                    _packed_linear_shapes[shape] = block_n
                    return
        _packed_linear_rejected.add(shape)


def packed_linear_reads(n: int, k: int) -> bool:
    """Whether ``linear`` sends few-row bf16 inputs of a packed [n, k] weight to
    ``packed_linear`` here (checking the shape first if needed): False where the kernels lack
    AVX512-BF16, or where oneDNN packs bf16 weights in a layout the kernel does not read."""
    _check_packed_linear(n, k)
    return (n, k) in _packed_linear_shapes


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, out_features: Optional[int] = None
) -> torch.Tensor:
    """y = x W^T + b for x [..., in] and W [out, in] (plain, ``pack_weight``'s output, or
    ``pack_w16``'s [ceil(out / 16), in, 16], which needs ``out_features``) -> [..., out], x's
    dtype.

    Raises:
        ValueError: a ``pack_w16`` weight without ``out_features``.
    """
    if weight.is_mkldnn:
        if x.dim() == 2 and x.shape[0] <= SMALL_M_ROWS and x.dtype == weight.dtype == torch.bfloat16:
            block_n = _packed_linear_shapes.get(tuple(weight.shape))
            if block_n is not None:
                from pagedllm.kernels import cpu as cpu_kernels

                return cpu_kernels.packed_linear(x, weight, bias, block_n)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.dim() == 3:
        if out_features is None:
            raise ValueError("linear: a pack_w16 weight needs out_features")
        from pagedllm.kernels import cpu as cpu_kernels

        y = cpu_kernels.linear_w16(x.reshape(-1, x.shape[-1]), weight, bias, out_features)
        return y.view(*x.shape[:-1], out_features)
    return F.linear(x, weight, bias)


_WIDENED_DTYPES = (torch.bfloat16, torch.float16)


def should_widen(weight: torch.Tensor) -> bool:
    """Whether a loaded plain weight [out, in] is to be multiplied by ``linear_w16``: 16-bit,
    on CPU, oneDNN cannot pack it here (``can_pack``), and the kernels are available."""
    return (
        not weight.is_mkldnn
        and weight.dim() == 2
        and weight.dtype in _WIDENED_DTYPES
        and weight.device.type == "cpu"
        and not can_pack(weight)
        and _kernels_available()
    )


def _kernels_available() -> bool:
    from pagedllm.kernels import cpu as cpu_kernels

    return cpu_kernels.is_available()


def pack_w16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in ``linear_w16``'s blocked layout (see
    ``pagedllm.kernels.cpu.pack_w16``). Call only when ``should_widen(weight)``."""
    from pagedllm.kernels import cpu as cpu_kernels

    return cpu_kernels.pack_w16(weight)


#: ``auto`` (default): float32 copies of widened 16-bit weights while they fit in a quarter of
#: the memory available when the first is made; ``1``: always; ``0``: never.
FP32_COPY_ENV = "PAGEDLLM_CPU_FP32_WEIGHT_COPY"
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
    mode = os.environ.get(FP32_COPY_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{FP32_COPY_ENV}={mode!r}: use auto, 0 or 1")
    if mode == "0":
        return None
    nbytes = weight.numel() * 4
    if mode == "auto":
        if _fp32_copy_budget is None:
            from pagedllm.platforms import current_platform

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


def describe_path(weight: torch.Tensor) -> str:
    """How ``linear`` multiplies by ``weight`` on this machine, for the start-up log."""
    if weight.is_mkldnn:
        few_rows = " (1-16 rows: packed_linear)" if tuple(weight.shape) in _packed_linear_shapes else ""
        return f"oneDNN-packed {str(weight.dtype).removeprefix('torch.')}{few_rows}"
    if weight.dim() == 3:
        return f"{str(weight.dtype).removeprefix('torch.')} widened to float32 in-kernel (linear_w16)"
    return f"torch {str(weight.dtype).removeprefix('torch.')} matmul"


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param`` (casting dtype).

    Raises:
        ValueError: if the shapes differ.
    """
    if param.shape != loaded_weight.shape:
        raise ValueError(f"Checkpoint tensor shape {tuple(loaded_weight.shape)} != parameter shape {tuple(param.shape)}.")
    param.data.copy_(loaded_weight)


class Linear(nn.Module):
    """y = x W^T + b. Weight [output_size, input_size], the module's dtype.

    After ``process_weights_after_loading`` on CPU, ``weight`` may be packed (oneDNN's layout,
    or ``pack_w16``'s [ceil(out / 16), in, 16] for ``linear_w16``); ``weight_fp32`` (a buffer,
    else None) is a float32 copy of a ``linear_w16`` weight for inputs of more than
    ``SMALL_M_ROWS`` rows (see ``fp32_weight_copy``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: Optional[nn.Parameter] = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.register_buffer("weight_fp32", None, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        default_weight_loader(param, loaded_weight)

    def process_weights_after_loading(self) -> None:
        """Pack the loaded weight for the CPU matmul: for oneDNN where it can (``can_pack``),
        else a 16-bit weight for ``linear_w16``, with its float32 copy where allowed (see the
        module docstring)."""
        if self.packed or self.weight.dim() == 3:
            return
        if can_pack(self.weight.data):
            self.weight = nn.Parameter(pack_weight(self.weight.data), requires_grad=False)
        elif should_widen(self.weight.data):
            self.weight_fp32 = fp32_weight_copy(self.weight.data)
            self.weight = nn.Parameter(pack_w16(self.weight.data), requires_grad=False)

    @property
    def packed(self) -> bool:
        """Whether the weight is packed for oneDNN (``process_weights_after_loading``)."""
        return self.weight.is_mkldnn

    def describe_path(self) -> str:
        """How this layer multiplies on this machine, for the start-up log."""
        copy = f" (> {SMALL_M_ROWS} rows: float32 copy)" if self.weight_fp32 is not None else ""
        return describe_path(self.weight) + copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_fp32 is not None and x.numel() > SMALL_M_ROWS * x.shape[-1]:
            bias = None if self.bias is None else self.bias.float()
            return linear(x.float(), self.weight_fp32, bias).to(x.dtype)
        return linear(x, self.weight, self.bias, self.output_size)


class FusedLinear(Linear):
    """Several linear maps of the same input, fused into one matmul.

    Args:
        input_size: features in.
        shard_sizes: output features of each fused map, in output order.
        shard_ids: the id of each shard as the model's checkpoint mapping names it.
    """

    def __init__(self, input_size: int, shard_sizes: Sequence[int], shard_ids: Sequence[ShardId], bias: bool = False) -> None:
        super().__init__(input_size, sum(shard_sizes), bias)
        offsets = [0]
        for size in shard_sizes:
            offsets.append(offsets[-1] + size)
        self.shard_slices = {sid: slice(offsets[i], offsets[i + 1]) for i, sid in enumerate(shard_ids)}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded_weight)
            return
        default_weight_loader(param.data[self.shard_slices[shard_id]], loaded_weight)


class QKVLinear(FusedLinear):
    """Fused q/k/v projection: output ``[q (num_heads*head_dim) | k | v (num_kv_heads*head_dim)]``."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        super().__init__(hidden_size, sizes, ("q", "k", "v"), bias)
        self.q_size, self.kv_size = sizes[0], sizes[1]
