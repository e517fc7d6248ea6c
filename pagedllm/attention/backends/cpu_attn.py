"""``CPU_ATTN``: paged attention by the C++ CPU kernel of ``pagedllm.kernels.cpu``.

The kernel computes decode attention (one query per request), reading K/V straight from the
blocks by block table, threaded over (request, kv head). Prefill tokens go through it too,
each as one more decode query: the builder gives every token its request's block table and
its position + 1 as context length (causal attention over the cached tokens and the chunk,
whose K/V are in the cache by then); the kernel computes such consecutive tokens of one
context (a chunk, or a speculative verifying step's 1 + k) together, each K/V row loaded once
for several of them. One kernel call per layer attends every token of the step: 3x
PyTorch's CPU flash attention on 128-token prompts, still faster at 8,192.

A decode-only step (the hot path) takes the runner's per-request arrays as they are.

A layer's sliding window, logits soft cap and attention sinks (``layer.sinks``) go to the
kernel as they are: a windowed query reads only the blocks of its window (the entries of
its block table before them are never looked up), soft-capping and sinks act on the
softmax.

The step's K/V go into the cache through the kernels' ``write_kv_cache`` (one call per layer;
an FP8 cache, ``--kv-cache-dtype fp8``, is quantized there) and the attention kernel reads
the cache directly, one byte per element for FP8. Except for prefills over an FP8 cache:
every query token of a prompt reads the whole context before it, and widening FP8 rows in
the kernel made prefill attention 0.87x as fast as over bfloat16. When a step's prefill
requests average ``FP8_WIDEN_MIN_QUERY_LEN`` query tokens or more (and their contexts hold
at most ``FP8_WIDEN_MAX_CONTEXT_TOKENS``), each layer widens their contexts' blocks once
(``kv_cache_quant.widen``, ~1 ms per 4k tokens) into a compact copy in the query's dtype,
and their tokens attend over that copy (block tables renumbered by the builder); decode
tokens still read the FP8 cache (for them it is faster).

Bidirectional ranges (``CommonAttentionMetadata.bidirectional_ranges``, Gemma 3's image
spans): a query inside a range gets the range's end as its context length
(``query_key_ends``) and its own position + 1 as its window end (``window_ends``), so that a
sliding window still ends at the query, not at the range's end; the kernel computes such a
token alone. Chunked local attention (Llama 4's ``attention_chunk_size`` C) is the kernel's
window starting at the query's chunk (position - position % C) instead.

With ``--batch-invariant`` the kernel forms no runs (``per_token``) and nothing is widened:
every token is computed alone, from the cache as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.attention.backends.abstract import AttentionMetadataBuilder, CommonAttentionMetadata
from pagedllm.attention.kv_cache_quant import is_fp8, widen
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.platforms import current_platform

#: Mean query tokens per prefill request from which a step's prefill contexts in an FP8
#: cache are widened once per layer rather than row by row in the kernel (per query token):
#: widening a row costs about what the kernel's widening of it for ~20 queries does.
FP8_WIDEN_MIN_QUERY_LEN = 32
#: At most this many context tokens are widened per layer (the copy is transient, one layer's
#: at a time: 16 MB for the 0.5B shape, 128 MB for 8 KV heads of 128); a step with more (many
#: long prefills at once) widens in the kernel instead.
FP8_WIDEN_MAX_CONTEXT_TOKENS = 32768


@dataclass
class CpuAttnMetadata(AttentionMetadata):
    """Attributes (one row per token of the step, every token a decode query):
    block_table: [num_tokens, max_blocks] int64, the token's request's block table.
    seq_lens: [num_tokens] int64, the token's position + 1 (inside a bidirectional range:
        the range's end).
    window_ends: [num_tokens] int64 or None: each token's position + 1, where a step has
        bidirectional ranges (its sliding window ends there); None otherwise.
    prefill_blocks: [num_context_blocks] int64 or None: the blocks of the prefill requests'
        contexts, request after request, when their contexts are to be widened (an FP8
        cache; see the module docstring); None otherwise.
    prefill_block_table: [num_prefill_tokens, width] int64 or None: each prefill token's
        block table into the compact copy ``cache[prefill_blocks]``.
    per_token: the kernel computes every token alone (``--batch-invariant``).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    prefill_blocks: Optional[torch.Tensor] = None
    prefill_block_table: Optional[torch.Tensor] = None
    per_token: bool = False
    window_ends: Optional[torch.Tensor] = None


class CpuAttnMetadataBuilder(AttentionMetadataBuilder[CpuAttnMetadata]):
    def build(self, common: CommonAttentionMetadata) -> CpuAttnMetadata:
        """Per-token block tables and context lengths: causal, or up to the end of a
        bidirectional range (no copies without prefills)."""
        block_table, seq_lens = common.block_table, common.seq_lens
        window_ends = None
        if common.num_prefills:
            token_req, seq_lens = common.tokens_as_decodes()
            block_table = block_table[token_req]
            if common.bidirectional_ranges is not None:
                window_ends, seq_lens = seq_lens, common.query_key_ends()
        metadata = CpuAttnMetadata(
            slot_mapping=self.to_device(common.slot_mapping),
            num_decodes=common.num_decodes,
            num_prefills=common.num_prefills,
            block_table=self.to_device(block_table),
            seq_lens=self.to_device(seq_lens),
            per_token=self.batch_invariant,
            window_ends=None if window_ends is None else self.to_device(window_ends),
        )
        if self.batch_invariant:
            return metadata
        if common.num_prefills and common.num_tokens - common.num_decodes >= FP8_WIDEN_MIN_QUERY_LEN * common.num_prefills:
            self._add_compact_prefill_tables(metadata, common)
        return metadata

    def _add_compact_prefill_tables(self, metadata: CpuAttnMetadata, common: CommonAttentionMetadata) -> None:
        """The prefill requests' context blocks, and each prefill token's table into them
        (none when they exceed ``FP8_WIDEN_MAX_CONTEXT_TOKENS``)."""
        num_decodes = common.num_decodes
        used = -(-common.seq_lens[num_decodes:] // self.block_size)  # blocks of each prefill request
        if used.sum() * self.block_size > FP8_WIDEN_MAX_CONTEXT_TOKENS:
            return
        width = int(used.max())
        columns = np.arange(width)
        blocks = common.block_table[num_decodes:, :width][columns[None, :] < used[:, None]]
        first = np.cumsum(used) - used  # request r's blocks start at first[r] in the copy
        table = np.minimum(first[:, None] + columns[None, :], len(blocks) - 1)  # padding: any valid block
        query_lens = np.diff(common.query_start_loc[num_decodes:])
        metadata.prefill_blocks = self.to_device(blocks)
        metadata.prefill_block_table = self.to_device(np.repeat(table, query_lens, axis=0))


class CpuAttnImpl(AttentionImpl[CpuAttnMetadata]):
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_sinks = True
    supports_chunked_local_attention = True
    supports_bidirectional_ranges = True

    def forward(self, layer: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CpuAttnMetadata) -> torch.Tensor:
        """See ``AttentionImpl.forward``; head_size must be contiguous in query and cache.

        Raises:
            RuntimeError: from the kernel, on bad shapes, dtypes, block ids or lengths.
        """
        md = attn_metadata
        k_scale, v_scale = self.kv_scales(layer, kv_cache)
        cpu_kernels.write_kv_cache(kv_cache[0], kv_cache[1], key, value, md.slot_mapping, k_scale, v_scale)
        output = torch.empty_like(query)
        features = {"sliding_window": self.sliding_window, "logits_soft_cap": self.logits_soft_cap,
                    "sinks": self.layer_sinks(layer), "attention_chunk_size": self.attention_chunk_size}
        if md.prefill_blocks is not None and is_fp8(kv_cache.dtype):
            self._attend_widened(output, query, kv_cache, md, k_scale, v_scale, features)
        else:
            cpu_kernels.paged_decode_attention(
                output, query, kv_cache[0], kv_cache[1], md.block_table, md.seq_lens, self.scale, k_scale, v_scale,
                per_token=md.per_token, window_ends=md.window_ends, **features,
            )
        return output

    def _attend_widened(self, output: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, md: CpuAttnMetadata,
                        k_scale: float, v_scale: float, features: dict) -> None:
        """Decode tokens over the FP8 cache; prefill tokens over their contexts' blocks widened
        to the query's dtype (``md.prefill_blocks``, see the module docstring); ``features``
        the kernel's window / soft cap / sinks / chunk arguments."""
        assert md.prefill_block_table is not None
        nd = md.num_decodes
        ends = (None, None) if md.window_ends is None else (md.window_ends[:nd], md.window_ends[nd:])
        if nd:
            cpu_kernels.paged_decode_attention(
                output[:nd], query[:nd], kv_cache[0], kv_cache[1], md.block_table[:nd], md.seq_lens[:nd], self.scale,
                k_scale, v_scale, window_ends=ends[0], **features,
            )
        # NOTE: index_select has no FP8 kernels; the blocks are gathered as bytes.
        blocks = kv_cache.view(torch.uint8).index_select(1, md.prefill_blocks).view(kv_cache.dtype)
        context, factor = widen(blocks, query.dtype)
        cpu_kernels.paged_decode_attention(
            output[nd:], query[nd:], context[0], context[1], md.prefill_block_table, md.seq_lens[nd:], self.scale,
            k_scale * factor, v_scale * factor, window_ends=ends[1], **features,
        )


class CpuAttnBackend(AttentionBackend):
    """The C++ CPU kernel; runs on CPU where ``pagedllm.kernels.cpu`` builds."""

    name = "CPU_ATTN"
    builder_cls = CpuAttnMetadataBuilder
    impl_cls = CpuAttnImpl

    @classmethod
    def validate_configuration(
        cls, head_size: int, dtype: torch.dtype, block_size: Optional[int], kv_cache_dtype: str = "auto",
        uses_sliding_window: bool = False, uses_logits_soft_cap: bool = False, has_sinks: bool = False,
        uses_bidirectional_ranges: bool = False, uses_chunked_local_attention: bool = False,
    ) -> list[str]:
        """The base checks (the kernel has windows, chunks, soft caps, sinks and bidirectional
        ranges: see the module docstring), the platform (CPU), and the kernels (built or
        loaded now, at start-up rather than in the first request; ~15 s the first time on a
        machine)."""
        reasons = super().validate_configuration(
            head_size, dtype, block_size, kv_cache_dtype, uses_sliding_window, uses_logits_soft_cap, has_sinks,
            uses_bidirectional_ranges, uses_chunked_local_attention,
        )
        if not current_platform.is_cpu:
            reasons.append(f"it runs on CPU only, not on {current_platform.device_type}")
            return reasons
        try:
            cpu_kernels.active_isa()  # raises with the reason when they are unavailable
        except RuntimeError as exc:
            reasons.append(str(exc))
        return reasons
