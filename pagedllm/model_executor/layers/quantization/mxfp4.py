"""MXFP4 checkpoints (config.json ``quantization_config`` quant_method "mxfp4": gpt-oss's
published experts), dequantized at load to the model dtype: no layer computes in MXFP4.

The format (OCP Microscaling spec v1.0, MXFP4): blocks of 32 consecutive values along a
matrix row, each an FP4 E2M1 code (sign, 2 exponent bits, 1 mantissa bit: +-{0, 0.5, 1, 1.5,
2, 3, 4, 6}) sharing one E8M0 scale 2^(s - 127). A checkpoint matrix W [..., rows, cols]
is stored as ``<name>_blocks`` uint8 [..., rows, cols / 32, 16] (two codes a byte, element
2j in the low nibble, 2j + 1 in the high one) and ``<name>_scales`` uint8 [..., rows,
cols / 32]; transformers reads the same layout (``integrations/mxfp4.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

logger = logging.getLogger(__name__)

#: The 16 E2M1 codes' values (bit 3 the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Elements per shared scale.
MXFP4_BLOCK = 32
_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` uint8 [..., rows, G, 16] and ``scales`` uint8 [..., rows, G] -> the matrix
    [..., rows, G x 32] in ``dtype`` (exact in float32 / bfloat16 / float16 within their range).

    Raises:
        ValueError: shapes that do not pair up (or not 16 bytes a block).
    """
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up "
            f"(expected [..., G, {MXFP4_BLOCK // 2}] and [..., G])."
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.reshape(*scales.shape, MXFP4_BLOCK)
    out = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return out.reshape(*scales.shape[:-1], -1).to(dtype)


def dequantize_mxfp4_weights(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                             transpose_suffixes: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each ``<name>_blocks`` / ``<name>_scales`` pair replaced by
    ``(<name>, dequantize_mxfp4(...))`` in ``dtype``, [..., rows, cols] (its view [..., cols,
    rows] where ``<name>`` ends with one of ``transpose_suffixes``); the pair's order and
    distance in the stream do not matter, the other tensors pass through. Warns once that it
    dequantizes.

    Raises:
        ValueError: a ``_blocks`` or ``_scales`` tensor left without its other half.
    """
    pending: dict[str, tuple[str, torch.Tensor]] = {}
    warned = False
    for name, tensor in weights:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        other = pending.pop(base, None)
        if other is None:
            pending[base] = (suffix, tensor)
            continue
        if not warned:
            logger.warning(
                "MXFP4 weights are dequantized to %s at load (pagedllm has no MXFP4 matmul): they take about "
                "%dx the checkpoint's memory.", str(dtype).removeprefix("torch."), torch.finfo(dtype).bits // 4,
            )
            warned = True
        blocks, scales = (tensor, other[1]) if suffix == "_blocks" else (other[1], tensor)
        try:
            matrix = dequantize_mxfp4(blocks, scales, dtype)
        except ValueError as error:
            raise ValueError(f"Checkpoint tensors {base}_blocks / {base}_scales: {error}") from None
        yield base, matrix.transpose(-1, -2) if transpose_suffixes and base.endswith(transpose_suffixes) else matrix
    if pending:
        names = [f"{base}{suffix}" for base, (suffix, _) in pending.items()]
        raise ValueError(f"MXFP4 checkpoint tensors without their blocks / scales counterpart: {', '.join(names[:8])}.")


class Mxfp4Config(QuantizationConfig):
    """quant_method "mxfp4": the checkpoint's MXFP4 tensors are dequantized by the model's
    loader (``dequantize_mxfp4_weights``), so every layer keeps its unquantized method.
    ``modules_to_not_convert`` (the layers the checkpoint left in 16 bits) needs no action."""

    @classmethod
    def get_name(cls) -> str:
        return "mxfp4"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Mxfp4Config":
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        return None
