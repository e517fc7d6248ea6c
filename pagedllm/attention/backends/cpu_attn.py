"""``CPU_ATTN``: paged attention by the C++ CPU kernel of ``pagedllm.kernels.cpu``.

The kernel computes decode attention (one query per request), reading K/V straight from the
blocks by block table, threaded over (request, kv head). Prefill tokens go through it too,
each as one more decode query: the builder gives every token its request's block table and
its position + 1 as context length (causal attention over the cached tokens and the chunk,
whose K/V are in the cache by then). One kernel call per layer attends every token of the
step: 3x PyTorch's CPU flash attention on 128-token prompts, still faster at 8,192.

A decode-only step (the hot path) takes the runner's per-request arrays as they are.

The step's K/V go into the cache through the kernels' ``write_kv_cache`` (one call per layer;
an FP8 cache, ``--kv-cache-dtype fp8``, is quantized there) and the attention kernel reads
the cache directly, one byte per element for FP8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.attention.backends.abstract import AttentionMetadataBuilder, CommonAttentionMetadata
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.platforms import current_platform


@dataclass
class CpuAttnMetadata(AttentionMetadata):
    """Attributes (one row per token of the step, every token a decode query):
    block_table: [num_tokens, max_blocks] int64, the token's request's block table.
    seq_lens: [num_tokens] int64, the token's position + 1.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor


class CpuAttnMetadataBuilder(AttentionMetadataBuilder[CpuAttnMetadata]):
    def build(self, common: CommonAttentionMetadata) -> CpuAttnMetadata:
        """Per-token block tables and causal context lengths (no copies without prefills)."""
        block_table, seq_lens = common.block_table, common.seq_lens
        if common.num_prefills:
            query_lens = np.diff(common.query_start_loc)
            token_req = np.repeat(np.arange(common.num_reqs), query_lens)
            block_table = block_table[token_req]
            # token t of request r (tokens [start_r, end_r)): position seq_len_r - (end_r - t).
            seq_lens = (common.seq_lens - common.query_start_loc[1:] + 1)[token_req] + np.arange(common.num_tokens)
        return CpuAttnMetadata(
            slot_mapping=self.to_device(common.slot_mapping),
            num_decodes=common.num_decodes,
            num_prefills=common.num_prefills,
            block_table=self.to_device(block_table),
            seq_lens=self.to_device(seq_lens),
        )


class CpuAttnImpl(AttentionImpl[CpuAttnMetadata]):
    def forward(self, layer: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CpuAttnMetadata) -> torch.Tensor:
        """See ``AttentionImpl.forward``; head_size must be contiguous in query and cache.

        Raises:
            RuntimeError: from the kernel, on bad shapes, dtypes, block ids or lengths.
        """
        k_scale, v_scale = self.kv_scales(layer, kv_cache)
        cpu_kernels.write_kv_cache(kv_cache[0], kv_cache[1], key, value, attn_metadata.slot_mapping, k_scale, v_scale)
        output = torch.empty_like(query)
        cpu_kernels.paged_decode_attention(
            output, query, kv_cache[0], kv_cache[1], attn_metadata.block_table, attn_metadata.seq_lens, self.scale,
            k_scale, v_scale,
        )
        return output


class CpuAttnBackend(AttentionBackend):
    """The C++ CPU kernel; runs on CPU where ``pagedllm.kernels.cpu`` builds."""

    name = "CPU_ATTN"
    builder_cls = CpuAttnMetadataBuilder
    impl_cls = CpuAttnImpl

    @classmethod
    def validate_configuration(
        cls, head_size: int, dtype: torch.dtype, block_size: Optional[int], kv_cache_dtype: str = "auto"
    ) -> list[str]:
        """The base checks, the platform (CPU), and the kernels (built or loaded now, at
        start-up rather than in the first request; ~15 s the first time on a machine)."""
        reasons = super().validate_configuration(head_size, dtype, block_size, kv_cache_dtype)
        if not current_platform.is_cpu:
            reasons.append(f"it runs on CPU only, not on {current_platform.device_type}")
            return reasons
        try:
            cpu_kernels.active_isa()  # raises with the reason when they are unavailable
        except RuntimeError as exc:
            reasons.append(str(exc))
        return reasons
