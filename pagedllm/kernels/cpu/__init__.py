"""The C++ CPU kernels: paged attention and KV-cache writes, RMSNorm / SwiGLU / rotary
embedding, greedy argmax, few-row and dequantizing matmuls on packed 16-, 8- and 4-bit
weights, multi-LoRA updates, fused mixture-of-experts layers, Mamba-2's decode step and the
gated delta rule (the ``.cpp`` files beside this one).

Built on first use, never at import, once per instruction-set level (``build``); the level
is chosen once per process from the CPU or ``PAGEDLLM_CPU_ISA`` (``runtime``). When no level
builds, or ``PAGEDLLM_DISABLE_CPU_KERNELS=1``, ``is_available()`` is False and callers use
their portable PyTorch code; the operators (``ops``) then raise ``RuntimeError``.
"""

from __future__ import annotations

from pagedllm.kernels.cpu.ops import (
    FEW_ROWS_MAX,
    paged_decode_attention,
    write_kv_cache,
    rms_norm,
    fused_add_rms_norm,
    silu_and_mul,
    rotary_embedding,
    argmax_rows,
    packed_linear,
    pack_w16,
    linear_w16,
    pack_w32,
    linear_rows,
    pack_w8,
    linear_w8,
    linear_fp8,
    pack_w4,
    pack_groups,
    linear_w4,
    linear_w8g,
    linear_dequant,
    pack_experts,
    fused_moe,
    fused_moe_w8,
    lora_sgmv,
    causal_conv1d_update,
    selective_state_update,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
)
from pagedllm.kernels.cpu.runtime import (
    DISABLE_ENV,
    active_isa,
    build_info,
    has_amx,
    has_packed_linear,
    is_available,
    reread_env,
    using_isa,
)

__all__ = [
    "DISABLE_ENV",
    "FEW_ROWS_MAX",
    "active_isa",
    "argmax_rows",
    "build_info",
    "causal_conv1d_update",
    "fused_add_rms_norm",
    "fused_moe",
    "fused_moe_w8",
    "gated_delta_rule_decode",
    "gated_delta_rule_prefill",
    "has_amx",
    "has_packed_linear",
    "is_available",
    "linear_dequant",
    "linear_fp8",
    "linear_rows",
    "linear_w16",
    "linear_w4",
    "linear_w8",
    "linear_w8g",
    "lora_sgmv",
    "pack_experts",
    "pack_groups",
    "pack_w16",
    "pack_w32",
    "pack_w4",
    "pack_w8",
    "packed_linear",
    "paged_decode_attention",
    "reread_env",
    "rms_norm",
    "rotary_embedding",
    "selective_state_update",
    "silu_and_mul",
    "using_isa",
    "write_kv_cache",
]
