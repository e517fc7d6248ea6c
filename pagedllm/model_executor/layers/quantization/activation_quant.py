"""Quantizing a linear layer's input activations to 8 bits, as compressed-tensors defines it
(``compressed_tensors.quantization``: ``calculate_qparams`` and the quantize op), so that a
W8A8 layer computes what llm-compressor calibrated and what transformers runs:

    symmetric scale  s = amax / (range / 2):  int8 range = 255 (q in [-128, 127]), so
                     s = amax / 127.5;  float8 e4m3 range = 896 (q in [-448, 448]), s = amax / 448
    int8:  q = round(clamp(x / s, -128, 127))  (round half to even)
    fp8:   q = float8_e4m3fn(clamp(x / s, -448, 448))  (round to nearest even)

with ``amax`` the largest |x| of each row (strategy "token", dynamic), of the whole input
(strategy "tensor", dynamic), or a checkpoint's ``input_scale`` (static, strategy "tensor").
An all-zero row gets s = 1 (its q is 0 whatever s is). NOTE: vLLM's dynamic int8 kernels use
s = amax / 127 instead; the difference is one step in 255 at the row's largest value, and
matching the library keeps our output equal to transformers' on the same checkpoint.
"""

from __future__ import annotations

from typing import Optional

import torch

#: The largest float8 e4m3 value (as ``fp8.FP8_E4M3_MAX``).
_FP8_MAX = 448.0


def _scale(x: torch.Tensor, per_token: bool, half_range: float, static_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """[M, 1] float32 scales of x [M, K] float32 (see the module docstring)."""
    if static_scale is not None:
        return static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    amax = x.abs().amax(dim=1, keepdim=True) if per_token else x.abs().amax().reshape(1, 1).expand(x.shape[0], 1)
    scale = amax / half_range
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_int8_activations(
    x: torch.Tensor, per_token: bool, static_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q [M, K] int8, s [M, 1] float32) with x ~ s * q:
    per row (``per_token``) or one scale for all of x, or ``static_scale`` (a one-element
    tensor) when given (see the module docstring)."""
    x = x.float()
    scale = _scale(x, per_token, 127.5, static_scale)
    return torch.round((x / scale).clamp_(-128.0, 127.0)).to(torch.int8), scale


def quantize_fp8_activations(
    x: torch.Tensor, per_token: bool, static_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q [M, K] float32 holding float8 e4m3 values exactly,
    s [M, 1] float32) with x ~ s * q (see ``quantize_int8_activations`` for the scale's choice)."""
    x = x.float()
    scale = _scale(x, per_token, _FP8_MAX, static_scale)
    return (x / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).float(), scale
