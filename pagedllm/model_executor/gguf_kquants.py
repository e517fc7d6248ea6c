"""llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K; ``ggml-common.h``'s ``block_q4_K`` ...) decoded
into ``packed_int``'s canonical integer layout, W = scale * (Q - zero) per group of inputs,
so that the grouped int kernels run them with the blocks' own arithmetic:

- Q4_K: super-blocks of 256 inputs, 144 bytes: d, dmin (float16), 12 bytes of eight 6-bit
  (scale, min) pairs, 128 bytes of 4-bit q. Sub-block j (32 inputs):
  W = d * sc_j * q - dmin * m_j, i.e. scale d * sc_j, zero (dmin * m_j) / (d * sc_j): int4,
  groups of 32, float zero points (``linear_w4``).
- Q5_K: as Q4_K plus 32 bytes of fifth bits before the 4-bit q (176 bytes): q in 0..31,
  int8 storage, groups of 32 (``linear_w8g``).
- Q6_K: 210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales, d:
  sub-block j (16 inputs) W = d * sc_j * (q - 32), q in 0..63: int8 storage, groups of 16,
  zero 32 (``linear_w8g``).

A sub-block with scale 0 (all its weights -dmin * m) becomes q = 1, scale -dmin * m, zero 0.
Every product d * sc and dmin * m is exact in float32 (11-bit by 6-bit mantissas); the only
rounding against ``gguf.quants.dequantize`` is the zero point's division, within float32's.
"""

from __future__ import annotations

import numpy as np

#: Inputs per K-quant super-block.
QK_K = 256

#: Bytes per super-block, by type.
_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def affine_to_canonical(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """Groups of W = scale * q - offset (q [out, in] uint8, scale / offset [out, in / group]
    float32) -> ``qweight`` / ``scales`` / ``qzeros`` with W = scales * (qweight - qzeros);
    a group with scale 0 becomes q = 1, scale -offset, zero 0."""
    flat = scale == 0
    zero = np.where(flat, 0.0, offset / np.where(flat, 1.0, scale)).astype(np.float32)
    q = q.copy()
    q.reshape(q.shape[0], -1, group)[flat] = 1
    return {"qweight": q, "scales": np.where(flat, -offset, scale).astype(np.float32), "qzeros": zero}


def float16_values(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (little-endian float16)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] uint8 of Q4_K / Q5_K -> the eight 6-bit (scale, min) pairs, each [..., 8]:
    pairs 0-3 are the low 6 bits of bytes 0-3 / 4-7; pairs 4-7 take their low 4 bits from
    bytes 8-11 (scale: low nibble, min: high nibble) and their top 2 from the top bits of
    bytes 0-3 / 4-7."""
    lo, hi, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([lo & 63, (extra & 15) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 63, (extra >> 4) | ((hi >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _low_nibbles_q4k(qs: np.ndarray) -> np.ndarray:
    """[..., 128] uint8 -> [..., 8, 32] 4-bit values: 32-byte chunk c holds sub-block 2c in its
    low nibbles and sub-block 2c + 1 in its high nibbles."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([chunks & 15, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def decode_k_blocks(raw: np.ndarray, type_name: str, num_inputs: int) -> dict[str, np.ndarray]:
    """Q4_K / Q5_K / Q6_K rows (``raw`` [out, super-blocks * bytes] uint8) -> ``qweight``
    [out, in] uint8, ``scales`` and ``qzeros`` [out, in / group] float32 (group 32, or 16 for
    Q6_K; see the module docstring).

    Raises:
        ValueError: a type that is not a K-quant, or rows that are not whole super-blocks.
    """
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"{type_name} is not a K-quant type; supported: {', '.join(_BLOCK_BYTES)}")
    out = raw.shape[0]
    if num_inputs % QK_K or raw.shape[1] != num_inputs // QK_K * _BLOCK_BYTES[type_name]:
        raise ValueError(f"{type_name} rows of {num_inputs} inputs are not whole {QK_K}-input super-blocks of this type")
    blocks = raw.reshape(out, num_inputs // QK_K, _BLOCK_BYTES[type_name])
    if type_name == "Q6_K":
        return _decode_q6_k(blocks, out, num_inputs)
    d, dmin = float16_values(blocks[..., 0:2]), float16_values(blocks[..., 2:4])
    sc, m = _scales_mins(blocks[..., 4:16])
    if type_name == "Q4_K":
        q = _low_nibbles_q4k(blocks[..., 16:144])
    else:
        high = (blocks[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8, 32]
        q = _low_nibbles_q4k(blocks[..., 48:176]) | (high << 4)
    scale = (d[..., None] * sc).reshape(out, -1)
    offset = (dmin[..., None] * m).reshape(out, -1)
    return affine_to_canonical(q.reshape(out, num_inputs).astype(np.uint8), scale, offset, 32)


def _decode_q6_k(blocks: np.ndarray, out: int, num_inputs: int) -> dict[str, np.ndarray]:
    """Q6_K super-blocks [out, n, 210] -> the canonical layout (groups of 16, zero 32). Each
    half of 128 inputs uses 64 bytes of ``ql`` and 32 of ``qh``; its quarter s (32 inputs,
    l = 0..31) is the low (s < 2) or high (s >= 2) nibble of ql[l + 32 * (s % 2)] with bits
    2s, 2s + 1 of qh[l] on top."""
    n = blocks.shape[1]
    ql = blocks[..., 0:128].reshape(out, n, 2, 2, 32)  # [half, byte run, l]
    qh = blocks[..., 128:192].reshape(out, n, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=-2)  # [half, quarter, l]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    q = (low | (high << 4)).reshape(out, num_inputs).astype(np.uint8)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    scale = (float16_values(blocks[..., 208:210])[..., None] * sc).reshape(out, -1)
    return {"qweight": q, "scales": scale.astype(np.float32), "qzeros": np.full_like(scale, 32.0)}
