"""Quantizing float weights into llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K) byte for byte,
for test and benchmark GGUF files: the ``gguf`` package reads and dequantizes these types but
cannot write them. The rounding is the plain one (each sub-block's range, then the 6- or
8-bit sub-block scales against the super-block's float16 d / dmin), not llama.cpp's
error-minimising search, so files are valid but slightly less accurate than
``llama-quantize``'s; the layout is ``ggml-common.h``'s ``block_q4_K`` / ``block_q5_K`` /
``block_q6_K``, and tests check it against ``gguf.quants.dequantize``.

    raw = quantize_k(weights, "Q4_K")   # [rows, in] float32 -> [rows, in / 256 * 144] uint8
"""

from __future__ import annotations

import numpy as np

#: Inputs per super-block.
_QK_K = 256


def _round_div(x: np.ndarray, scale: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """round(x / scale) clipped to [lo, hi], 0 where scale is 0."""
    safe = np.where(scale == 0, 1.0, scale)
    return np.where(scale == 0, 0, np.clip(np.round(x / safe), lo, hi))


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """[...] float16 -> [..., 2] uint8 (little-endian)."""
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(*values.shape, 2)


def _quantize_q4_q5(x: np.ndarray, nmax: int) -> tuple[np.ndarray, ...]:
    """Super-blocks x [rows, n, 8, 32] -> (d, dmin as float16 [rows, n], sc, m [rows, n, 8],
    q [rows, n, 8, 32]) with x ~ d * sc * q - dmin * m, q in [0, nmax]."""
    low = np.minimum(x.min(-1), 0.0)
    sub_scale, sub_min = (x.max(-1) - low) / nmax, -low
    d = (sub_scale.max(-1) / 63).astype(np.float16)
    dmin = (sub_min.max(-1) / 63).astype(np.float16)
    sc = _round_div(sub_scale, d.astype(np.float32)[..., None], 0, 63)
    m = _round_div(sub_min, dmin.astype(np.float32)[..., None], 0, 63)
    scale = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = _round_div(x + offset[..., None], scale[..., None], 0, nmax)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit (scale, min) pairs [..., 8] -> their 12 bytes (see ``gguf_kquants``)."""
    return np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                           (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)  # fmt: skip


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 8, 32] 4-bit values -> [..., 128] bytes: chunk c = sub-block 2c | sub-block 2c + 1 << 4."""
    return (q[..., 0::2, :] & 15 | (q[..., 1::2, :] & 15) << 4).reshape(*q.shape[:-2], 128)


def _quantize_q6(x: np.ndarray) -> np.ndarray:
    """Super-blocks x [rows, n, 256] -> Q6_K bytes [rows, n, 210]."""
    sub = x.reshape(*x.shape[:-1], 16, 16)
    extreme = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    sub_scale = extreme / -32
    top = np.take_along_axis(sub_scale, np.abs(sub_scale).argmax(-1)[..., None], -1)[..., 0]
    d = (top / -128).astype(np.float16)
    sc = _round_div(sub_scale, d.astype(np.float32)[..., None], -128, 127)
    q = _round_div(sub, (d.astype(np.float32)[..., None] * sc)[..., None], -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(*x.shape[:-1], 2, 4, 32)  # [half, quarter, l]
    ql = (q[..., 0:2, :] & 15) | ((q[..., 2:4, :] & 15) << 4)  # [half, byte run, l]
    qh = sum(((q[..., s, :] >> 4) & 3) << (2 * s) for s in range(4)).astype(np.uint8)  # [half, l]
    rows, n = x.shape[:2]
    return np.concatenate([ql.reshape(rows, n, 128), qh.reshape(rows, n, 64),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=-1)  # fmt: skip


def quantize_k(weights: np.ndarray, type_name: str) -> np.ndarray:
    """``weights`` [rows, in] float32 (``in`` a multiple of 256) -> the rows' ``type_name``
    (Q4_K, Q5_K or Q6_K) super-blocks, [rows, in / 256 * bytes per block] uint8.

    Raises:
        ValueError: another type, or ``in`` not a multiple of 256.
    """
    rows, k = weights.shape
    if k % _QK_K or type_name not in ("Q4_K", "Q5_K", "Q6_K"):
        raise ValueError(f"Cannot write {type_name} rows of {k} inputs (Q4_K / Q5_K / Q6_K, multiples of {_QK_K}).")
    x = weights.astype(np.float32).reshape(rows, k // _QK_K, _QK_K)
    if type_name == "Q6_K":
        return _quantize_q6(x).reshape(rows, -1)
    d, dmin, sc, m, q = _quantize_q4_q5(x.reshape(rows, -1, 8, 32), 15 if type_name == "Q4_K" else 31)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_scales_mins(sc, m)]
    if type_name == "Q5_K":
        parts.append(sum(((q[..., j, :] >> 4) & 1) << j for j in range(8)).astype(np.uint8))
    parts.append(_pack_nibbles(q))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)
