"""FP8 KV cache arithmetic (``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2``): how keys and
values are stored in one byte and read back, and the per-layer scales.

A layer's keys are stored as ``fp8(key / k_scale)``, rounded to nearest and saturating at
the format's largest value (448 for e4m3, 57344 for e5m2), and read as
``float(fp8) * k_scale``; values likewise with ``v_scale`` (vLLM's per-tensor scales).
The scales come from the checkpoint (``pagedllm.model_executor.kv_cache_scales``), else 1.0,
or from the first batch with ``--calculate-kv-scales`` (``calculate_kv_scales``).
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

#: vLLM's divisors of the first batch's absolute maximum (its ``K_SCALE_CONSTANT`` and
#: ``V_SCALE_CONSTANT`` defaults): keys land within +-200, values within +-100, leaving e4m3
#: (max 448) headroom for later, larger activations.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the FP8 cache types."""
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` as ``dtype`` (FP8), in float32 math, round to nearest even, saturating
    at +-``torch.finfo(dtype).max`` (NaN stays NaN). Returns a new tensor of x's shape."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def widen(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """FP8 ``x`` as ``dtype`` (bfloat16, float16 or float32), exactly, divided by a power of
    two: returns ``(y, factor)`` with ``y * factor == x``, y a new tensor of x's shape.

    Bit moves rather than torch's float8 conversion (7x slower on CPU): an e5m2 byte is the
    top byte of the float16 of its value (factor 1); an e4m3 byte, sign-extended, shifted
    left by 7 and with bit 14 (a sign copy) cleared, is the float16 of its value / 256
    (factor 256, subnormals included). NaN bytes read as finite values (e4m3's as +-480),
    as in the C++ kernels; the cache writers saturate, so only NaN keys or values make them.
    """
    if x.dtype == torch.float8_e5m2:
        half, factor = x.view(torch.uint8).to(torch.int16).bitwise_left_shift_(8), 1.0
    else:
        half, factor = x.view(torch.int8).to(torch.int16).bitwise_left_shift_(7).bitwise_and_(-0x4080), 256.0
    half = half.view(torch.float16)
    # NOTE: float16 -> float32 -> bfloat16 is twice as fast as float16 -> bfloat16 on CPU.
    return (half if dtype == torch.float16 else half.float().to(dtype)), factor


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``x`` times ``scale`` as ``dtype`` (every FP8 value is exact in bfloat16,
    float16 and float32; the product is rounded once to ``dtype``). A new tensor; NaN
    bytes read as ``widen`` reads them."""
    out, factor = widen(x, dtype)
    return out.mul_(scale * factor) if scale * factor != 1.0 else out


def calculate_kv_scales(key: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
    """vLLM's dynamic scales (``Attention.calc_kv_scales``): ``amax(|key|) / 200`` and
    ``amax(|value|) / 100`` over the batch (one host sync). A tensor whose maximum is 0
    or not finite keeps scale 1.0.

    Returns:
        (k_scale, v_scale) as floats.
    """
    scales = []
    for x, divisor in ((key, K_SCALE_CONSTANT), (value, V_SCALE_CONSTANT)):
        amax = x.abs().amax().item() if x.numel() else 0.0
        scales.append(amax / divisor if 0.0 < amax < float("inf") else 1.0)
    return scales[0], scales[1]
