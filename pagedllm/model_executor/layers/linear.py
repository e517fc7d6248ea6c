"""Linear layers (vLLM's shapes): ``ReplicatedLinear``, ``ColumnParallelLinear``,
``MergedColumnParallelLinear``, ``QKVParallelLinear`` and ``RowParallelLinear``, each holding a
``quant_method`` (a ``LinearMethodBase``) that creates, prepares and applies its weight.

Sharding: a column-parallel layer holds this rank's rows of W (output features), a
row-parallel one this rank's columns (input features; its outputs are summed over the ranks
by ``tensor_model_parallel_all_reduce``); ranks and sizes come from
``pagedllm.distributed.parallel_state`` (at tensor-parallel size 1 every layer holds all of W).
Several checkpoint matrices may be fused into one layer (q/k/v into ``qkv_proj``, gate/up
into ``gate_up_proj``); each parameter carries a ``weight_loader`` that copies this rank's
part of a checkpoint tensor into its shard. Output rows of a fused layer are the shards
stacked in order: ``[q | k | v]`` or ``[gate | up]`` (per rank).

``UnquantizedLinearMethod`` keeps weights in the model dtype. On CPU, once loaded, they are
re-laid out in oneDNN's blocked format for the matmul (``pack_weight``;
``process_weights_after_loading``). The product is bit-identical in bf16
and equal up to float32 summation order in float32, and much faster for the small row
counts of decode steps, measured on a 2-core AVX-512-BF16 machine (GFLOP/s, 896 -> 9728):
1 row 42 -> 109, 32 rows 231 -> 402, 512 rows 406 -> 417 (``torch.nn.functional.linear``
-> packed). A packed ``weight`` keeps its shape but is an opaque ``torch._mkldnn``
tensor: use it only through ``linear``. ``PAGEDLLM_DISABLE_CPU_KERNELS=1`` keeps the plain layout.

Packed bf16 weights of a shape whose layout ``pack_weight`` has checked (oneDNN blocks them
by 64 outputs on AVX512-BF16 and by 32 where it uses AMX) go, for inputs of
at most ``SMALL_M_ROWS`` rows, through ``pagedllm.kernels.cpu.packed_linear`` instead of
oneDNN's matmul: a weight-streaming kernel that reads the same packed bytes (the decode
steps of few requests, and speculative decoding's verifying steps, 1 + k rows per request;
see ``packed_linear.cpp``). Which of its two paths it takes is decided once per shape (no
timing, so every run computes the same sums):

- 64-output blocks (AVX512-BF16 without AMX, e.g. Zen 4): vdpbf16ps, 1.3-1.6x oneDNN's
  matmul at 1-16 rows (2-core Zen 4);
- 32-output blocks where the CPU and OS allow AMX tiles (``has_amx``): AMX tiles, whose
  sums are oneDNN's own (bit-identical to its matmul at 1-16 rows on the shapes tested, and
  row by row the same at any row count up to 16: at batch 1, a verifying step's logits are
  a plain decode step's; oneDNN's matmul of more rows keeps that up to 32 rows on the
  shapes tested, not beyond where K > 256: 40 rows of the 0.5B shape's qkv differ).
  Measured on a 2-core Xeon VM with AMX (one thread, process CPU time, alternating in one
  process on a loaded machine; ``benchmarks/small_m_linear.py``, docs/benchmarks.md), time
  relative to vdpbf16ps on the same layout, shipped model / 0.5B shape: 1 row 0.81-0.97 /
  0.80-1.03, 5 rows 0.37-0.62 / 0.41-0.79, 16 rows 0.16-0.29 / 0.18-0.42; and 0.27-0.96 of
  oneDNN's matmul at 1-16 rows (its per-call set-up dominates small layers). A verifying
  step of 5 tokens on the shipped model went from 1.23-1.34x a 1-token step to 1.07-1.13x;
  1-token steps: 0.90-0.95 on the 0.5B shape, 0.96-1.05 on the shipped model (noise-level).
  The alternative, choosing per shape and row count between vdpbf16ps and oneDNN's matmul
  by a timing probe at load, is slower than the tiles at every shape and row count
  measured, and a timed choice would not be reproducible from run to run.

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

import threading
from abc import abstractmethod
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.distributed import (
    divide,
    kv_heads_per_rank,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels import isa
from pagedllm.model_executor.layers.quantization import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.utils import default_weight_loader, load_weight_part, set_weight_attrs
from pagedllm.platforms import current_platform

ShardId = Union[str, int]

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

# Rows up to which ``linear`` uses the packed-weight streaming kernel rather than oneDNN's
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
    """Decide, once per [n, k] shape, whether ``linear`` may send few-row inputs to
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
            kernel = _packed_linear_shapes.get(tuple(weight.shape))
            if kernel is not None:
                return cpu_kernels.packed_linear(x, weight, bias, *kernel)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.dim() == 3:
        if out_features is None:
            raise ValueError("linear: a pack_w16 weight needs out_features")
        y = cpu_kernels.linear_w16(x.reshape(-1, x.shape[-1]), weight, bias, out_features)
        return y.view(*x.shape[:-1], out_features)
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


class LinearMethodBase(QuantizeMethodBase):
    """How a linear layer stores and applies its weight W (y = x W^T + b)."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """Register on ``layer`` what stores this rank's [sum(output_partition_sizes),
        input_size_per_partition] part of the [output_size, input_size] matrix, each parameter
        with ``extra_weight_attrs`` (``weight_loader`` ...) as attributes."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., input_size_per_partition] -> [..., layer.output_size_per_partition], x's dtype."""


class UnquantizedLinearMethod(LinearMethodBase):
    """W in the model dtype, ``weight`` [out, in]; a ``weight_fp32`` buffer (else None).

    ``process_weights_after_loading`` picks the matmul once, from ``current_platform``: on CPU
    oneDNN's packed layout where it can (``can_pack``), else ``pack_w16``'s [ceil(out / 16),
    in, 16] for ``linear_w16`` with a float32 copy in ``weight_fp32`` for inputs of more
    than ``SMALL_M_ROWS`` rows (``fp32_weight_copy``; see the module docstring); elsewhere
    the plain weight and torch's matmul.
    """

    #: Whether a ``linear_w16`` weight also gets a float32 copy (``fp32_weight_copy``).
    float32_copy = True

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype), requires_grad=False
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        layer.register_buffer("weight_fp32", None, persistent=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Re-lay out the loaded weight for this machine's matmul (see the class docstring);
        a second call changes nothing."""
        weight = layer.weight.data
        if not current_platform.is_cpu or weight.is_mkldnn or weight.dim() != 2:
            return
        if can_pack(weight):
            layer.weight = nn.Parameter(pack_weight(weight), requires_grad=False)
        elif should_widen(weight):
            if self.float32_copy:
                layer.weight_fp32 = fp32_weight_copy(weight)
            layer.weight = nn.Parameter(pack_w16(weight), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight_fp32 = layer.weight_fp32
        if weight_fp32 is not None and x.numel() > SMALL_M_ROWS * x.shape[-1]:
            return linear(x.float(), weight_fp32, None if bias is None else bias.float()).to(x.dtype)
        return linear(x, layer.weight, bias, layer.output_size_per_partition)

    def describe_path(self, layer: nn.Module) -> str:
        weight = layer.weight
        dtype = str(weight.dtype).removeprefix("torch.")
        if weight.is_mkldnn:
            kernel = _packed_linear_shapes.get(tuple(weight.shape))
            tiles = ", AMX tiles" if kernel is not None and kernel[1] else ""
            few_rows = f" (1-{SMALL_M_ROWS} rows: packed_linear{tiles})" if kernel is not None else ""
            path = f"oneDNN-packed {dtype}{few_rows}"
        elif weight.dim() == 3:
            path = f"{dtype} widened to float32 in-kernel (linear_w16)"
        else:
            path = f"torch {dtype} matmul"
        copy = f" (> {SMALL_M_ROWS} rows: float32 copy)" if layer.weight_fp32 is not None else ""
        return path + copy


class LinearBase(nn.Module):
    """A linear layer y = x W^T + b (W [output_size, input_size]) whose ``quant_method``
    creates, prepares and applies its weight.

    Args:
        input_size, output_size: features of the whole matrix (all ranks together).
        params_dtype: dtype of the parameters (None: torch's default dtype).
        quant_config: picks ``quant_method`` via ``get_quant_method(self, prefix)``; None,
            or a None answer: ``UnquantizedLinearMethod``.
        prefix: the layer's name in the model (``model.layers.0.mlp.down_proj``).

    Subclasses set ``input_size_per_partition`` and ``output_size_per_partition`` (this
    rank's features) through ``_create_weights``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        params_dtype: Optional[torch.dtype] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        method = None if quant_config is None else quant_config.get_quant_method(self, prefix)
        self.quant_method: QuantizeMethodBase = method or UnquantizedLinearMethod()

    def _create_weights(
        self, input_size_per_partition: int, output_partition_sizes: list[int], bias: bool, bias_sharded: bool
    ) -> None:
        """Let ``quant_method`` create the weight of this rank's part, and add a bias [this
        rank's outputs if ``bias_sharded``, else all of them] in ``params_dtype``."""
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.output_size_per_partition = sum(output_partition_sizes)
        self.quant_method.create_weights(
            self, input_size_per_partition, output_partition_sizes, self.input_size, self.output_size,
            self.params_dtype, weight_loader=self.weight_loader,
        )
        if not bias:
            self.register_parameter("bias", None)
            return
        size = self.output_size_per_partition if bias_sharded else self.output_size
        self.bias = nn.Parameter(torch.empty(size, dtype=self.params_dtype), requires_grad=False)
        set_weight_attrs(self.bias, {"weight_loader": self.weight_loader, **({"output_dim": 0} if bias_sharded else {})})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's part of a checkpoint tensor into ``param`` (one of this layer's)."""
        raise NotImplementedError

    def input_part(self) -> tuple[int, int]:
        """(this rank's part, number of equal parts) of W's input features: (0, 1), all of
        them, unless the layer is row-parallel. A LoRA A [r, in] is cut the same way."""
        return 0, 1

    def output_part(self, index: int) -> tuple[int, int]:
        """(this rank's part, number of equal parts) of fused matrix ``index``'s output
        features: (0, 1), all of them, unless the layer is column-parallel. A LoRA B
        [out, r] of that matrix is cut the same way."""
        return 0, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size_per_partition] -> [..., output_size_per_partition], x's dtype."""
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole: [..., input_size] -> [..., output_size].
    ``kwargs``: ``LinearBase``'s (params_dtype, quant_config, prefix)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self._create_weights(input_size, [output_size], bias, bias_sharded=False)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy a checkpoint tensor into ``param``.

        Raises:
            ValueError: if the shapes differ.
        """
        default_weight_loader(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: this rank holds rows [rank x out / tp_size, ...)
    of W (and of the bias) and computes those outputs.

    Args:
        gather_output: whether ``forward`` concatenates the ranks' outputs (all_gather) into
            [..., output_size]; else it returns this rank's [..., output_size_per_partition].
        output_sizes: the sizes of fused matrices stacked in W (default ``[output_size]``),
            each split evenly across ranks: this rank's W is their parts, stacked.
        kwargs: ``LinearBase``'s (params_dtype, quant_config, prefix).

    Raises:
        ValueError: an output size not divisible by the tensor-parallel size.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        output_sizes: Optional[Sequence[int]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.gather_output = gather_output
        self.output_sizes = list(output_sizes or [output_size])
        #: The name of each fused matrix for ``weight_loader`` (``loaded_shard_id``).
        self.shard_ids: list[ShardId] = list(range(len(self.output_sizes)))
        self._create_weights(input_size, [divide(size, self.tp_size) for size in self.output_sizes], bias, bias_sharded=True)

    def output_part(self, index: int) -> tuple[int, int]:
        """(this rank's part, number of parts) of fused matrix ``index``'s checkpoint rows."""
        return self.tp_rank, self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: Optional[ShardId] = None) -> None:
        """Copy this rank's rows of a checkpoint tensor into ``param``: of fused matrix
        ``loaded_shard_id`` (one of ``shard_ids``), or (None) of the whole W, whose fused
        matrices are then stacked in the checkpoint tensor in order.

        Raises:
            ValueError: a wrong shape or an unknown shard id.
        """
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # not split by output (a quantized format's scalar, say)
            default_weight_loader(param, loaded_weight)
            return
        if loaded_shard_id is None and len(self.shard_ids) > 1:
            self._load_fused(param, loaded_weight, output_dim)
            return
        index = 0 if loaded_shard_id is None else self._shard_index(loaded_shard_id)
        offset = sum(self.output_partition_sizes[:index])
        param_data = param.data.narrow(output_dim, offset, self.output_partition_sizes[index])
        load_weight_part(param_data, loaded_weight, output_dim, *self.output_part(index))

    def _shard_index(self, shard_id: ShardId) -> int:
        if shard_id not in self.shard_ids:
            raise ValueError(f"Unknown shard id {shard_id!r}; this layer's are {self.shard_ids}.")
        return self.shard_ids.index(shard_id)

    def _load_fused(self, param: nn.Parameter, loaded_weight: torch.Tensor, output_dim: int) -> None:
        """Load a checkpoint tensor holding every fused matrix, stacked, shard by shard."""
        rows = [size * self.output_part(i)[1] for i, size in enumerate(self.output_partition_sizes)]
        if loaded_weight.shape[output_dim] != sum(rows):
            raise ValueError(
                f"Checkpoint tensor shape {tuple(loaded_weight.shape)}: dimension {output_dim} should be "
                f"{' + '.join(map(str, rows))} (the fused matrices {self.shard_ids})."
            )
        for shard_id, part in zip(self.shard_ids, loaded_weight.split(rows, dim=output_dim)):
            self.weight_loader(param, part, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size] with ``gather_output``, else
        [..., output_size_per_partition]; x's dtype."""
        out = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            out = tensor_model_parallel_all_gather(out)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices of the same input fused into one matmul (gate/up):
    ``output_sizes`` are their output features, in output order; shard ids are their
    indices (0, 1, ...). ``kwargs``: ``ColumnParallelLinear``'s (gather_output ...)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = True, **kwargs: Any) -> None:
        super().__init__(input_size, sum(output_sizes), bias, output_sizes=output_sizes, **kwargs)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection of ``hidden_size`` inputs. Per rank, output
    ``[q (num_heads x head_size) | k | v (num_kv_heads x head_size)]``: ``total_num_heads /
    tp_size`` query heads, and ``total_num_kv_heads / tp_size`` KV heads, or one KV head
    replicated on ``tp_size / total_num_kv_heads`` ranks when there are at least as many
    ranks as KV heads. Shard ids "q", "k", "v". ``kwargs``: ``LinearBase``'s (params_dtype,
    quant_config, prefix).

    Raises:
        ValueError: head counts that do not split across the ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: Optional[int] = None,
        bias: bool = True,
        **kwargs: Any,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = kv_heads_per_rank(self.total_num_kv_heads, tp_size)
        self.num_kv_head_replicas = max(1, tp_size // self.total_num_kv_heads)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # Sizes over all ranks, replicas counted, so that each splits evenly (vLLM's convention).
        sizes = [self.q_size * tp_size, self.kv_size * tp_size, self.kv_size * tp_size]
        super().__init__(hidden_size, sum(sizes), bias, output_sizes=sizes, **kwargs)
        self.shard_ids = ["q", "k", "v"]

    def output_part(self, index: int) -> tuple[int, int]:
        if index == 0:
            return self.tp_rank, self.tp_size
        return self.tp_rank // self.num_kv_head_replicas, self.tp_size // self.num_kv_head_replicas


class RowParallelLinear(LinearBase):
    """Input features split across ranks: this rank holds columns [rank x in / tp_size, ...)
    of W and takes x [..., input_size_per_partition] (a column-parallel layer's output); the
    bias (whole) is added on rank 0 only.

    Args:
        reduce_results: whether ``forward`` sums the ranks' partial outputs (all_reduce).
        kwargs: ``LinearBase``'s (params_dtype, quant_config, prefix).

    Raises:
        ValueError: an input size not divisible by the tensor-parallel size.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, reduce_results: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.reduce_results = reduce_results
        self._create_weights(divide(input_size, self.tp_size), [output_size], bias, bias_sharded=False)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's columns of a checkpoint tensor into ``param`` (the whole bias).

        Raises:
            ValueError: a wrong shape.
        """
        load_weight_part(param.data, loaded_weight, getattr(param, "input_dim", None), *self.input_part())

    def input_part(self) -> tuple[int, int]:
        return self.tp_rank, self.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size_per_partition] -> [..., output_size], x's dtype (this rank's
        partial sum unless ``reduce_results``)."""
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
