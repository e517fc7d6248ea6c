"""The C++ CPU kernels' operators, as typed Python functions.

Each function calls the active build's operator (``runtime.namespace()``), resolved at the
first call and kept until the choice of build changes (``runtime.on_change``): no per-call
lookup or availability check. Any function raises ``RuntimeError`` when the kernels are
unavailable (with the reason) and on bad shapes / dtypes (the kernels' checks). The
operators are defined in the ``.cpp`` files beside this one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.kernels.cpu import runtime


class _Unresolved:
    """Stands for the operator namespace until the first call: resolves and binds it."""

    def __getattr__(self, name: str) -> Any:
        global _ns
        _ns = runtime.namespace()
        return getattr(_ns, name)


_UNRESOLVED = _Unresolved()
_ns: Any = _UNRESOLVED


def _unbind() -> None:
    global _ns
    _ns = _UNRESOLVED


runtime.on_change(_unbind)


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    portable: bool = False,
    per_token: bool = False,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    attention_chunk_size: Optional[int] = None,
    window_ends: Optional[torch.Tensor] = None,
) -> None:
    """Decode attention (one query per request) over the paged KV cache, into ``out``.

    Args:
        out: [B, Hq, D], the dtype of ``query``; written in place.
        query: [B, Hq, D]; float32, bfloat16 or float16 (accumulation is float32).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] (``kv_cache[0]``,
            ``kv_cache[1]`` of a layer's cache); head_dim contiguous. Hq % Hkv == 0. The
            query's dtype, or float8_e4m3fn / float8_e5m2 (an FP8 cache, widened exactly).
        block_table: [B, max_blocks] int64 (other integer dtypes are converted).
        seq_lens: [B] int64 (likewise), context length including the new token; cache
            positions at or beyond it are not read.
        scale: softmax scale (any: it multiplies q.k before the soft cap and the softmax).
        k_scale, v_scale: an FP8 cache's scales: keys are ``k_scale * key_cache``, values
            ``v_scale * value_cache``.
        portable: run the kernel's portable loops whatever the build (for tests).
        per_token: compute every query token alone, never several consecutive tokens of one
            context together: a token's output is then the same whatever else is in the call
            (``--batch-invariant``).
        sliding_window: W tokens: a query of context length n attends to positions
            max(0, n - W) .. n - 1 only; the blocks wholly before them are never read (their
            block-table entries may be any id). None: the whole context.
        logits_soft_cap: scores become ``cap * tanh(score / cap)`` before the softmax
            (Gemma 2's ``attn_logit_softcapping``); None: none.
        sinks: [Hq] float32 (other float dtypes are converted): a logit per query head that
            joins the softmax's denominator only (gpt-oss); None: none.
        attention_chunk_size: C tokens: chunked local attention, a query of context length n
            attends to positions (n - 1) - (n - 1) % C .. n - 1 only, its aligned chunk (Llama
            4; the blocks before are never read); None: none. Not with ``sliding_window``.
        window_ends: [B] int64 (likewise), for queries that see keys past themselves (a
            bidirectional image span: ``seq_lens`` holds the span's end): each query's
            position + 1, where its sliding window ends (it attends max(0, e - W) ..
            seq_len - 1); None: ``seq_lens``.

    Raises:
        RuntimeError: if the kernels are unavailable, or on bad shapes, dtypes, block ids,
            lengths (a window end outside 1 .. seq_len), windows, chunks or caps.
    """
    ops = _ns
    if portable:
        op = ops.paged_decode_attention_portable
    else:
        op = ops.paged_decode_attention_per_token if per_token else ops.paged_decode_attention
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()  # no copy when it is already
    op(out, query, key_cache, value_cache, block_table.long(), seq_lens.long(), float(scale), float(k_scale),
       float(v_scale), sliding_window or 0, float(logits_soft_cap or 0.0), sinks, attention_chunk_size or 0,
       None if window_ends is None else window_ends.long())


def write_kv_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Store each token's key and value in its slot (``pagedllm.attention.paged_kv_cache``'s
    ``write_to_kv_cache`` in one call, byte for byte the same).

    Args:
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] (``kv_cache[0]``,
            ``kv_cache[1]``), head_dim contiguous: the key's dtype, or float8_e4m3fn /
            float8_e5m2 (then stored as ``key / k_scale``, rounded to nearest even,
            saturated at the format's largest value).
        key, value: [num_tokens, Hkv, D]; float32, bfloat16 or float16.
        slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset.
        k_scale, v_scale: FP8 scales; unused for a cache of the key's dtype.

    Raises:
        RuntimeError: unavailable kernels, bad shapes or dtypes, or a slot out of range.
    """
    _ns.write_kv_cache(key_cache, value_cache, key, value, slot_mapping.long(), float(k_scale), float(v_scale))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * to_dtype(x * rsqrt(mean(x^2) + eps))`` over the last dimension (HF's
    LlamaRMSNorm; float32 math), for x [T, D] or [T, H, D] with the last dimension
    contiguous (any outer strides). Returns a new contiguous tensor of x's shape.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes (weight [D], x's dtype).
    """
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    _ns.rms_norm(out, x3, weight, float(eps))
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, for x and residual [T, D]: ``residual = to_dtype(x + residual)``, then
    ``x = rms_norm(residual)`` (see ``rms_norm``).

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _ns.fused_add_rms_norm(x, residual, weight, float(eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of x [T, 2d] = [gate | up]: ``to_dtype(to_dtype(silu(gate)) * up)`` -> [T, d].

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    _ns.silu_and_mul(out, x)
    return out


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate query [T, Hq, D] and key [T, Hk, D] in place (neox layout, HF's
    ``apply_rotary_pos_emb`` with its bf16 roundings) by cos / sin [T, D] of x's dtype.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    _ns.rotary_embedding(query, key, cos, sin)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for logits [B, V] (float32 / bfloat16 / float16, V
    contiguous): first index of each row's maximum (or of its first NaN), [B] int64.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    return _ns.argmax_rows(logits)


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 64, amx: bool = False
) -> torch.Tensor:
    """``x W^T + b`` for a few rows: x [M, K] bfloat16 (last dimension contiguous), weight
    [N, K] bfloat16 packed by ``torch.ops.mkldnn._reorder_linear_weight`` into oneDNN's
    ``block_n``-output x 32-input blocks (64 on AVX512-BF16, 32 where oneDNN uses AMX;
    ``linear.py`` checks the layout per shape), bias [N] or None -> [M, N] bfloat16, float32
    accumulation. ``amx``: with AMX tiles (block_n 32, M <= 16, ``has_amx()``), whose sums
    are oneDNN's own; else with vdpbf16ps. Faster than oneDNN's own matmul from 1 to 16 rows
    (see ``packed_linear.cpp``).

    Raises:
        RuntimeError: unavailable kernels, a build without AVX512-BF16, or bad shapes /
            dtypes / layout / block_n, or ``amx`` where it cannot run.
    """
    return _ns.packed_linear(x, weight, bias, block_n, amx)


def pack_w16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] bfloat16 / float16 re-laid out for ``linear_w16``: a new tensor
    [ceil(N / 16), K, 16] of the same dtype, blocks of 16 outputs with each input's 16 weights
    together, the last block padded with zeros (see ``linear_w16.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or a bad shape / dtype.
    """
    return _ns.pack_w16(weight)


def linear_w16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T + b`` with 16-bit weights widened to float32 (float32 products and sums): x
    [M, K] float32 / bfloat16 / float16 (last dimension contiguous), weight ``pack_w16``'s
    output for W [n, K], bias [n] or None -> [M, n] in x's dtype. Up to 16 rows a
    weight-streaming kernel (AVX2 and up); more rows, torch's float32 GEMM on chunks of
    widened weights (see ``linear_w16.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    return _ns.linear_w16(x, weight, bias, n)


def pack_w32(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] float32 in ``pack_w16``'s layout ([ceil(N / 16), K, 16], float32),
    for ``linear_rows``.

    Raises:
        RuntimeError: unavailable kernels, or a bad shape / dtype.
    """
    return _ns.pack_w32(weight)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T + b`` computed row by row in one fixed order (``--batch-invariant``): each
    row of the output is the same float32 sums whatever the number of rows and the other
    rows' values. x [M, K] float32 / bfloat16 / float16, weight ``pack_w16``'s or
    ``pack_w32``'s output for W [n, K], bias [n] or None -> [M, n] in x's dtype (see
    ``linear_w16.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    return _ns.linear_rows(x, weight, bias, n)


def pack_w8(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] int8 re-laid out for ``linear_w8``: [ceil(N / 16), K, 16] int8, the
    layout of ``pack_w16`` (see ``linear_w16.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or a bad shape / dtype.
    """
    return _ns.pack_w8(weight)


def linear_w8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """``(x Q^T) * scale + b`` for int8 weights Q [n, K] with one float32 scale per output
    (W = scale[:, None] * Q): x [M, K] float32 / bfloat16 / float16, weight ``pack_w8``'s
    output, scale [n] float32 contiguous, bias [n] or None -> [M, n] in x's dtype; float32
    products and sums. M <= ``FEW_ROWS_MAX``: a weight-streaming kernel (AVX2 and up) reading
    one byte per weight; on the portable level torch's float32 GEMM on chunks of widened
    weights. More rows go to ``linear_dequant``.

    Raises:
        RuntimeError: unavailable kernels, more than ``FEW_ROWS_MAX`` rows, or bad shapes /
            dtypes.
    """
    return _ns.linear_w8(x, weight, scale, bias, n)


def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """``linear_w8`` for float8 e4m3 weights F [n, K] (W = scale[:, None] * F): weight is F's
    bytes packed by ``pack_w8`` and viewed back as ``torch.float8_e4m3fn``; widened to float32
    exactly inside the kernel (see ``linear_w16.cpp``); at most ``FEW_ROWS_MAX`` rows.

    Raises:
        RuntimeError: unavailable kernels, more than ``FEW_ROWS_MAX`` rows, or bad shapes /
            dtypes.
    """
    return _ns.linear_fp8(x, weight, scale, bias, n)


def pack_w4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] uint8 of 4-bit values (0-15, K even) re-laid out for ``linear_w4``:
    [ceil(N / 16), K / 2, 16] uint8, blocks of 16 outputs with inputs 2i and 2i + 1 in the
    low and high nibble of one byte (see ``linear_grouped.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or a bad shape / dtype.
    """
    return _ns.pack_w4(weight)


def pack_groups(values: torch.Tensor) -> torch.Tensor:
    """Per-group scales or zero points [N, G] re-laid out as the weight blocks are, for
    ``linear_w4`` / ``linear_w8g`` / ``linear_dequant``: [ceil(N / 16), G, 16], the 16 outputs
    of a block side by side per group (zero padded), so the decode kernels load a group's 16
    values at once instead of gathering them from 16 rows (see ``group_scales.h``). Pure
    PyTorch; keeps the dtype."""
    n, groups = values.shape
    blocks = -(-n // 16)
    padded = torch.nn.functional.pad(values, (0, 0, 0, blocks * 16 - n))
    return padded.view(blocks, 16, groups).transpose(1, 2).contiguous()


def linear_w4(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    int8_activations: bool = False,
) -> torch.Tensor:
    """``x W^T + b`` for 4-bit weights W[n, k] = scale[n, g] * (Q[n, k] - zero[n, g]), g = k //
    group_size: x [M, K] float32 / bfloat16 / float16, weight ``pack_w4``'s output for Q [n, K],
    scale [n, K / group_size] float32 or float16 and zero float32 of the same shape, or None for
    symmetric weights (zero 8 everywhere: read nothing), contiguous (group_size even), or both
    ``pack_groups``' blocked layout (faster at few rows), bias [n] or None -> [M, n] in x's
    dtype; float32 products and sums. M <= ``FEW_ROWS_MAX``: a
    weight-streaming kernel (AVX2 and up) reading half a byte per weight; on the portable
    level torch's float32 GEMM on chunks of dequantized weights (see ``linear_grouped.cpp``).
    More rows go to ``linear_dequant``.

    ``int8_activations``: when group_size is a multiple of 32, x is first
    quantized to int8 per block of 32 inputs (symmetric, float32 scale max|x| / 127, round half
    to even; llama.cpp's Q8_0 activations) and multiplied with exact int32 dot products
    (AVX512-VNNI, AVX-512BW / AVX2 vpmaddubsw, or plain loops; see ``int8_dot.h``): faster, and
    exactly ``x_q W^T`` up to float32 summation, x_q the dequantized int8 x. Otherwise ignored.

    Raises:
        RuntimeError: unavailable kernels, more than ``FEW_ROWS_MAX`` rows, or bad shapes /
            dtypes.
    """
    return _ns.linear_w4(x, weight, scale, zero, bias, n, int8_activations)


def linear_w8g(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    int8_activations: bool = False,
) -> torch.Tensor:
    """``linear_w4`` for 8-bit unsigned weights (W = scale * (Q - zero) per group, Q 0-255):
    weight is Q [n, K] uint8 in ``pack_w8``'s layout ([ceil(n / 16), K, 16] uint8; pack its
    bytes viewed as int8), scale and zero as ``linear_w4``'s (zero None: 128 everywhere; see
    ``linear_grouped.cpp``); at most ``FEW_ROWS_MAX`` rows.

    Raises:
        RuntimeError: unavailable kernels, more than ``FEW_ROWS_MAX`` rows, or bad shapes /
            dtypes.
    """
    return _ns.linear_w8g(x, weight, scale, zero, bias, n, int8_activations)


#: Rows of x the few-row kernels (``linear_w8``, ``linear_fp8``, ``linear_w8g``, ``linear_w4``)
#: take at most (``kStreamRows`` in ``weight_blocks.h``); ``linear_w16`` takes any number.
FEW_ROWS_MAX = 16



def linear_dequant(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    bits: int,
    tile_cols: int = 0,
) -> torch.Tensor:
    """``x W^T + b`` for many rows of x against 8- or 4-bit weights, dequantized tile by tile
    into a GEMM of bfloat16 (x bfloat16 on an AVX512-BF16 build: oneDNN, with AMX where
    present) or float32 (elsewhere), never a whole dequantized layer (see
    ``linear_dequant.cpp``). x [M, K] float32 / bfloat16 / float16 (last dimension
    contiguous), bias [n] or None -> [M, n] in x's dtype. The weights, as the few-row kernels
    take them:

    - ``linear_w8``'s: weight int8 (``pack_w8``), scale [n], zero None, bits 8;
    - ``linear_fp8``'s: weight float8_e4m3fn in ``pack_w8``'s layout, scale [n], zero None, bits 8;
    - ``linear_w8g``'s: weight uint8 in ``pack_w8``'s layout, scale / zero [n, G], bits 8;
    - ``linear_w4``'s: weight uint8 (``pack_w4``), scale / zero [n, G] (even groups), bits 4
      (for both: scale float32 or float16, zero float32 or None for 2^(bits - 1), [n, G] or
      ``pack_groups``' [ceil(n / 16), G, 16]).

    ``tile_cols``: outputs per tile, a multiple of 16 (0: about 512 KB of dequantized
    weights per tile, the tiles spread evenly over the threads); for benchmarks.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes.
    """
    return _ns.linear_dequant(x, weight, scale, zero, bias, n, bits, tile_cols)


def pack_experts(weight: torch.Tensor) -> torch.Tensor:
    """Stacked expert matrices ``weight`` [E, N, K] bfloat16 / float16 / float32 (int8, for
    ``fused_moe_w8``) re-laid out for ``fused_moe``: [E, ceil(N / 16), K, 16] of the same
    dtype, each expert's matrix in ``pack_w16``'s (``pack_w8``'s) blocks (the last block padded with zeros; see ``fused_moe.cpp``).

    Raises:
        RuntimeError: unavailable kernels, or a bad shape / dtype.
    """
    return _ns.pack_experts(weight)


def fused_moe(
    x: torch.Tensor,
    token_rows: torch.Tensor,
    weights: torch.Tensor,
    counts: list[int],
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A ``FusedMoE`` layer's routed experts in one call (see ``fused_moe.cpp``): x [T, H]
    float32 / bfloat16 / float16; the (token, choice) pairs sorted by expert as
    ``ExpertGroups`` holds them (``token_rows`` [P] int64, ``weights`` [P] float32, ``counts``
    one int per expert summing to P); ``w13`` / ``w2`` ``pack_experts``' output for W13
    [E, N13, H] and W2 [E, H, I] (one dtype: bfloat16 / float16 / float32); ``activation``
    "silu" (W13 = [gate | up], N13 = 2 I: silu(gate) * up) or "relu2_no_mul" (W13 = up,
    N13 = I: relu(up)^2); biases [E, N13] / [E, H] or None. Returns [T, H] in x's dtype: per
    token the routing-weighted sum of its experts' outputs, float32 products and sums.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes / row indices.
    """
    return _ns.fused_moe(x, token_rows, weights, counts, w13, w2, activation, w13_bias, w2_bias)


def fused_moe_w8(
    x: torch.Tensor,
    token_rows: torch.Tensor,
    weights: torch.Tensor,
    counts: list[int],
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    activation: str,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``fused_moe`` for weight-only int8 experts: ``w13`` / ``w2`` ``pack_experts``' output
    for int8 Q13 [E, N13, H] / Q2 [E, H, I], ``w13_scale`` [E, N13] / ``w2_scale`` [E, H]
    float32 per output channel (W = scale[..., None] * Q, as ``quantize_int8_per_channel``).
    Activations stay float32 (the weights are widened in registers, no int8 GEMM), so the
    result is a float32 matmul on the dequantized weights up to the order of the sums.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes / row indices.
    """
    return _ns.fused_moe_w8(x, token_rows, weights, counts, w13, w2, w13_scale, w2_scale, activation,
                            w13_bias, w2_bias)


def lora_sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              groups: torch.Tensor, output_sizes: list[int]) -> None:
    """Add each token's LoRA update to ``y`` in place, the whole mixed batch in one call
    (see ``lora.cpp``): y [T, N] and x [T, K] of one dtype (float32 / bfloat16 / float16),
    lora_a [S, K, J * R] and lora_b [S, R, N] both float32 or both x's dtype, groups [G, 3] int64 rows (slot,
    start, end), output_sizes the J slice widths summing to N.

    Raises:
        RuntimeError: unavailable kernels, or bad shapes / dtypes / groups.
    """
    _ns.lora_sgmv(y, x, lora_a, lora_b, groups, output_sizes)


def causal_conv1d_update(
    x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], silu: bool,
    cache_indices: torch.Tensor,
) -> torch.Tensor:
    """One decode step of a depthwise causal conv (``mamba.ops.causal_conv1d_update``'s maths,
    see ``mamba_decode.cpp``): x [B, dim] float32 / bfloat16 / float16 (dim contiguous),
    conv_states [slots, dim, width - 1] of x's dtype (rolled in place), weight [dim, width]
    and bias [dim] or None of x's dtype, ``silu`` the activation, cache_indices [B] int32 /
    int64 slots -> [B, dim] in x's dtype.

    Raises:
        RuntimeError: unavailable kernels, bad shapes / dtypes, or a slot out of range.
    """
    return _ns.causal_conv1d_update(x, conv_states, weight, bias, silu, cache_indices)


def selective_state_update(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], z: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], dt_softplus: bool,
    state_batch_indices: torch.Tensor, dt_min: float, dt_max: float,
) -> torch.Tensor:
    """One Mamba-2 decode step per request (``mamba.ops.selective_state_update``'s maths, see
    ``mamba_decode.cpp``), one pass over each (request, head)'s state: state [slots, nheads,
    head_dim, d_state] float32 (updated in place), x [B, nheads, head_dim], dt [B, nheads],
    B / C [B, ngroups, d_state], z like x or None (one dtype: float32 / bfloat16 / float16;
    last dimensions contiguous), A, D, dt_bias [nheads] (converted to float32; D, dt_bias may
    be None), state_batch_indices [B] int32 / int64, dt clamped to [dt_min, dt_max] after the
    softplus -> [B, nheads, head_dim] in x's dtype.

    Raises:
        RuntimeError: unavailable kernels, bad shapes / dtypes, or a slot out of range.
    """
    D = None if D is None else D.float()
    dt_bias = None if dt_bias is None else dt_bias.float()
    return _ns.selective_state_update(state, x, dt, A.float(), B, C, D, z, dt_bias, dt_softplus,
                                      state_batch_indices, float(dt_min), float(dt_max))


def gated_delta_rule_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    cache_indices: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:
    """One gated-delta-rule step per request (``mamba.ops.gated_delta``'s
    ``fused_recurrent_gated_delta_rule`` maths, see ``gated_delta.cpp``): q, k [B, H, K], v
    [B, HV, V] of one dtype (float32 / bfloat16 / float16; last dimensions contiguous), g, beta
    [B, HV] (converted to float32), state [slots, HV, K, V] float32 or v's dtype (last two
    dimensions contiguous; updated in place), cache_indices [B] int32 / int64, ``scale`` on q
    after the optional L2 norm -> [B, HV, V] in v's dtype.

    Raises:
        RuntimeError: unavailable kernels, bad shapes / dtypes, or a slot out of range.
    """
    return _ns.gated_delta_rule_decode(q, k, v, g.float().contiguous(), beta.float().contiguous(), state,
                                       cache_indices, float(scale), use_qk_l2norm)


def gated_delta_rule_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    query_start_loc: torch.Tensor, cache_indices: torch.Tensor, has_initial_state: torch.Tensor, scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """The gated delta rule over a varlen batch of prefill chunks (``chunk_gated_delta_rule``'s
    maths, computed token by token, see ``gated_delta.cpp``): q, k [T, H, K], v [T, HV, V], g,
    beta [T, HV], state, scale and use_qk_l2norm as ``gated_delta_rule_decode``'s;
    query_start_loc [R + 1] and cache_indices [R] int32 / int64, has_initial_state [R]
    (converted to bool; False: the request starts from zeros) -> [T, HV, V] in v's dtype, each
    request's final state written to its slot.

    Raises:
        RuntimeError: unavailable kernels, bad shapes / dtypes / bounds, or a slot out of range.
    """
    return _ns.gated_delta_rule_prefill(q, k, v, g.float().contiguous(), beta.float().contiguous(), state,
                                        query_start_loc, cache_indices, has_initial_state.bool().contiguous(),
                                        float(scale), use_qk_l2norm)
