"""``TORCH_SDPA``: paged attention in portable PyTorch (CPU and CUDA); the reference the
other backends are tested against.

Decodes (one query each) are computed together: their contexts are gathered from the cache
by block table into a padded [num_decodes, max_len] batch masked by sequence length, with
the query heads that share a KV head laid along SDPA's query axis (grouped-query attention
without repeating K/V).

Prefills (a whole prompt, or a chunk after tokens already cached) are computed together
too: their contexts are gathered the same way, their queries padded to the longest chunk
(a padding row repeats its request's last query and is dropped), and one SDPA call with a
causal mask offset by each request's cached length (``enable_gqa``). The chunk's K/V are in
the cache by then.

A layer with a ``sliding_window`` W masks, besides, the keys a query at position i does
not see (positions <= i - W), and zeroes the gathered keys and values before every query's
window, as those past the context: their blocks may hold anything (a KV-cache manager may
have given them to other requests), NaN included. A layer of chunked local attention
(``attention_chunk_size`` C, Llama 4) does the same with the keys before its query's aligned
chunk (positions < i - i % C). The windowed masks are built once per step and window or
chunk, by the first such layer, and kept in the metadata for the others.

A layer with a ``logits_soft_cap`` or attention sinks (``layer.sinks``) attends by explicit
float32 matrix products instead of SDPA (which has neither): scores ``scale * q.k``,
``cap * tanh(score / cap)``, masked, each head's sink logit appended as one more column of
the softmax and dropped after it (transformers' Gemma 2 and gpt-oss eager attention).

An FP8 cache (``--kv-cache-dtype fp8``) is read the same way, its gathered contexts
dequantized to the query's dtype (``pagedllm.attention.paged_kv_cache.gather_context``),
with torch's float8 types: the same code runs on CUDA.

A request's ``bidirectional_ranges`` (Gemma 3's image spans) widen its prefill queries' causal
masks: a query inside a range sees keys up to the range's end (the window still bounds them
from below), as transformers' ``token_type_ids`` mask.

Masks and gather indices are built once per step by the builder, not per layer.

With ``--batch-invariant`` every token, decode or prefill, is attended alone over exactly
its own context (one SDPA call per token, no padding and no mask): its output then depends
on its own context only, not on the other tokens of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.attention.backends.abstract import AttentionMetadataBuilder, CommonAttentionMetadata
from pagedllm.attention.paged_kv_cache import gather_context, write_to_kv_cache


@dataclass
class TorchSDPAMetadata(AttentionMetadata):
    """Attributes (device tensors; the ``prefill_*`` ones None without prefills):
        decode_block_table: [num_decodes, nb] int64 block tables.
        decode_valid: [num_decodes, nb * block_size] bool; position < seq_len.
        prefill_block_table: [num_prefills, nb'] int64 block tables.
        prefill_valid: [num_prefills, max_seq_len] bool; position < seq_len.
        prefill_query_index: [num_prefills, max_query_len] int64; the token (counted from
            the first prefill token) of each padded query row.
        prefill_mask: [num_prefills, 1, max_query_len, max_seq_len] bool; causal mask of
            each padded query row over its request's context.
        prefill_output_index: [num_prefill_tokens] int64; the padded rows, flattened, that
            are real tokens, in token order.
        decode_positions: [num_decodes] int64; each decode query's position (seq_len - 1).
        prefill_positions: [num_prefills, max_query_len] int64; each padded query row's position.
        token_seq_lens: ``--batch-invariant``: the keys each token sees, 0 .. n - 1 (host
            ints: its position + 1, or its bidirectional range's end); the ``decode_*`` tables
            then have one row per token, and ``prefill_*`` are None.
        token_positions: ``--batch-invariant``: each token's position (host ints).
    """

    decode_block_table: torch.Tensor
    decode_valid: torch.Tensor
    prefill_block_table: Optional[torch.Tensor] = None
    prefill_valid: Optional[torch.Tensor] = None
    prefill_query_index: Optional[torch.Tensor] = None
    prefill_mask: Optional[torch.Tensor] = None
    prefill_output_index: Optional[torch.Tensor] = None
    decode_positions: Optional[torch.Tensor] = None
    prefill_positions: Optional[torch.Tensor] = None
    token_seq_lens: Optional[list[int]] = None
    token_positions: Optional[list[int]] = None
    _window_masks: dict = field(default_factory=dict, repr=False)

    def decode_keys(self, window: Optional[int], chunk: Optional[int] = None) -> torch.Tensor:
        """[num_decodes, nb * block_size] bool: the keys each decode query attends to (its
        context; with ``window`` W, its last W positions only; with ``chunk`` C, those of its
        own aligned chunk of C positions only)."""
        return self._windowed("decode", window, chunk, self.decode_valid, self.decode_positions)

    def prefill_keys(self, window: Optional[int], chunk: Optional[int] = None) -> torch.Tensor:
        """[num_prefills, max_seq_len] bool: ``prefill_valid``, with ``window`` W (``chunk`` C)
        only the positions some query sees (from the first query's window or chunk on)."""
        assert self.prefill_valid is not None and self.prefill_positions is not None
        return self._windowed("prefill_keys", window, chunk, self.prefill_valid, self.prefill_positions[:, 0])

    def prefill_attn_mask(self, window: Optional[int], chunk: Optional[int] = None) -> torch.Tensor:
        """``prefill_mask``, with ``window`` W also hiding keys at positions <= i - W from a
        query at position i (with ``chunk`` C, keys before i - i % C)."""
        assert self.prefill_mask is not None and self.prefill_positions is not None
        return self._windowed("prefill", window, chunk, self.prefill_mask, self.prefill_positions[:, None])

    def _windowed(self, name: str, window: Optional[int], chunk: Optional[int], mask: torch.Tensor,
                  positions: Optional[torch.Tensor]) -> torch.Tensor:
        """``mask`` [..., L] (as it is without ``window`` and ``chunk``) less the keys before
        each query position p's first visible key (``positions``, of mask's shape without L):
        p - W + 1 with ``window`` W, p - p % C with ``chunk`` C; built once per step and kind."""
        if window is None and chunk is None:
            return mask
        key = (name, window, chunk)
        if key not in self._window_masks:
            assert positions is not None
            keys = torch.arange(mask.shape[-1], device=mask.device)
            first = positions - positions % chunk if chunk is not None else positions - window + 1
            self._window_masks[key] = mask & (keys >= first.unsqueeze(-1))
        return self._window_masks[key]


class TorchSDPAMetadataBuilder(AttentionMetadataBuilder[TorchSDPAMetadata]):
    def build(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        """Decode tables and masks; prefill tables, padded query indices and causal masks."""
        if self.batch_invariant:
            return self._build_per_token(common)
        num_decodes = common.num_decodes
        decode_table, decode_valid = self._tables(common.block_table[:num_decodes], common.seq_lens[:num_decodes])
        metadata = TorchSDPAMetadata(
            slot_mapping=self.to_device(common.slot_mapping),
            num_decodes=num_decodes,
            num_prefills=common.num_prefills,
            decode_block_table=decode_table,
            decode_valid=decode_valid,
            decode_positions=self.to_device(common.seq_lens[:num_decodes] - 1),
        )
        if common.num_prefills:
            self._add_prefills(metadata, common)
        return metadata

    def _build_per_token(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        """Every token as a decode of its own: its request's block table, the keys it sees."""
        token_req, positions = common.tokens_as_decodes()
        seq_lens = common.query_key_ends()
        table, valid = self._tables(common.block_table[token_req], seq_lens)
        return TorchSDPAMetadata(
            slot_mapping=self.to_device(common.slot_mapping),
            num_decodes=common.num_decodes,
            num_prefills=common.num_prefills,
            decode_block_table=table,
            decode_valid=valid,
            token_seq_lens=seq_lens.tolist(),
            token_positions=(positions - 1).tolist(),
        )

    def _tables(self, block_table: np.ndarray, seq_lens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables cut to the longest context, and [B, nb * block_size] valid positions."""
        width = int(-(-seq_lens.max() // self.block_size)) if len(seq_lens) else 1
        table = self.to_device(np.ascontiguousarray(block_table[:, :width]))
        lens = self.to_device(seq_lens)
        valid = torch.arange(width * self.block_size, device=self.device)[None, :] < lens[:, None]
        return table, valid

    def _add_prefills(self, metadata: TorchSDPAMetadata, common: CommonAttentionMetadata) -> None:
        num_decodes = common.num_decodes
        starts = common.query_start_loc[num_decodes:] - common.query_start_loc[num_decodes]
        query_lens = np.diff(starts)
        seq_lens = common.seq_lens[num_decodes:]
        max_query_len, max_seq_len = int(query_lens.max()), int(seq_lens.max())
        table, valid = self._tables(common.block_table[num_decodes:], seq_lens)
        row = np.minimum(np.arange(max_query_len)[None, :], query_lens[:, None] - 1)  # padding repeats the last
        query_pos = self.to_device((seq_lens - query_lens)[:, None] + row)
        query_index = starts[:-1, None] + row
        metadata.prefill_block_table = table
        metadata.prefill_valid = valid[:, :max_seq_len]
        metadata.prefill_query_index = self.to_device(query_index)
        if common.bidirectional_ranges is None:
            key_ends = query_pos + 1
        else:  # each padded row's token's key end (the prefill tokens follow the decodes)
            key_ends = self.to_device(common.query_key_ends()[common.num_decodes + query_index])
        metadata.prefill_mask = (torch.arange(max_seq_len, device=self.device) < key_ends[:, :, None])[:, None]
        metadata.prefill_positions = query_pos
        real = np.arange(max_query_len)[None, :] < query_lens[:, None]
        metadata.prefill_output_index = self.to_device(np.flatnonzero(real))


class TorchSDPAImpl(AttentionImpl[TorchSDPAMetadata]):
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_sinks = True
    supports_bidirectional_ranges = True
    supports_chunked_local_attention = True

    def _first_key(self, position: int) -> int:
        """The first key position a query at ``position`` sees (its window's or chunk's start)."""
        if self.attention_chunk_size is not None:
            return position - position % self.attention_chunk_size
        return 0 if self.sliding_window is None else max(0, position + 1 - self.sliding_window)

    def forward(self, layer: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        """See ``AttentionImpl.forward``."""
        scales = self.kv_scales(layer, kv_cache)
        write_to_kv_cache(kv_cache, key, value, attn_metadata.slot_mapping, *scales)
        sinks = self.layer_sinks(layer)
        num_decodes = attn_metadata.num_decodes
        if attn_metadata.token_seq_lens is not None:
            return self._per_token(query, kv_cache, scales, attn_metadata, sinks)
        if not attn_metadata.num_prefills:
            return self._decode(query, kv_cache, scales, attn_metadata, sinks)
        output = torch.empty_like(query)
        if num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], kv_cache, scales, attn_metadata, sinks)
        output[num_decodes:] = self._prefill(query[num_decodes:], kv_cache, scales, attn_metadata, sinks)
        return output

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor],
                sinks: Optional[torch.Tensor]) -> torch.Tensor:
        """q [N, Hkv, M, D] (M query rows per kv head: ``group`` heads x ``M / group`` query
        positions, heads outer), keys and values [N, Hkv, L, D], mask bool broadcastable to
        [N, Hkv, M, L] (True: attended) or None -> [N, Hkv, M, D] in q's dtype. SDPA without
        a soft cap or sinks; else explicit float32 products (see the module docstring)."""
        if self.logits_soft_cap is None and sinks is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)).mul_(self.scale)
        if self.logits_soft_cap is not None:
            scores = scores.div_(self.logits_soft_cap).tanh_().mul_(self.logits_soft_cap)
        if mask is not None:
            scores = scores.masked_fill_(~mask, float("-inf"))
        if sinks is not None:
            group = self.num_heads // self.num_kv_heads
            rows = sinks.float().view(self.num_kv_heads, group).repeat_interleave(q.shape[2] // group, dim=1)
            scores = torch.cat([scores, rows[None, :, :, None].expand(*scores.shape[:-1], 1)], dim=-1)
        probs = scores.softmax(dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        return torch.matmul(probs, values.float()).to(q.dtype)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, scales: tuple[float, float],
                md: TorchSDPAMetadata, sinks: Optional[torch.Tensor]) -> torch.Tensor:
        """[num_decodes, num_heads, head_size] queries -> their attention output."""
        num_decodes = query.shape[0]
        group = self.num_heads // self.num_kv_heads
        attended = md.decode_keys(self.sliding_window, self.attention_chunk_size)
        keys = gather_context(kv_cache[0], md.decode_block_table, attended, query.dtype, scales[0])
        values = gather_context(kv_cache[1], md.decode_block_table, attended, query.dtype, scales[1])
        q = query.view(num_decodes, self.num_kv_heads, group, self.head_size)
        out = self._attend(q, keys, values, attended[:, None, None, :], sinks)
        return out.reshape(num_decodes, self.num_heads, self.head_size)

    def _per_token(self, query: torch.Tensor, kv_cache: torch.Tensor, scales: tuple[float, float],
                   md: TorchSDPAMetadata, sinks: Optional[torch.Tensor]) -> torch.Tensor:
        """[num_tokens, num_heads, head_size] queries, each over exactly the keys it sees (in a
        windowed layer those after its position - ``sliding_window``, gathered from their blocks only)."""
        assert md.token_seq_lens is not None and md.token_positions is not None
        output = torch.empty_like(query)
        group = self.num_heads // self.num_kv_heads
        block_size = kv_cache.shape[2]
        for t, (seq_len, position) in enumerate(zip(md.token_seq_lens, md.token_positions)):
            start = self._first_key(position)
            first_block, width = start // block_size, -(-seq_len // block_size)
            table = md.decode_block_table[t : t + 1, first_block:width]
            valid = md.decode_valid[t : t + 1, first_block * block_size : seq_len]
            skip = start - first_block * block_size
            keys = gather_context(kv_cache[0], table, valid, query.dtype, scales[0])[:, :, skip:]
            values = gather_context(kv_cache[1], table, valid, query.dtype, scales[1])[:, :, skip:]
            q = query[t].view(1, self.num_kv_heads, group, self.head_size)
            out = self._attend(q, keys, values, None, sinks)
            output[t] = out.reshape(self.num_heads, self.head_size)
        return output

    def _prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, scales: tuple[float, float],
                 md: TorchSDPAMetadata, sinks: Optional[torch.Tensor]) -> torch.Tensor:
        """[num_prefill_tokens, num_heads, head_size] queries -> their attention output."""
        assert md.prefill_block_table is not None and md.prefill_query_index is not None
        assert md.prefill_output_index is not None
        attended = md.prefill_keys(self.sliding_window, self.attention_chunk_size)
        keys = gather_context(kv_cache[0], md.prefill_block_table, attended, query.dtype, scales[0])
        values = gather_context(kv_cache[1], md.prefill_block_table, attended, query.dtype, scales[1])
        q = query[md.prefill_query_index].transpose(1, 2)  # [P, num_heads, max_query_len, D]
        # [P, 1, max_query_len, max_seq_len]
        mask = md.prefill_attn_mask(self.sliding_window, self.attention_chunk_size)
        if self.logits_soft_cap is None and sinks is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        else:
            num_prefills, _, query_len, _ = q.shape
            group = self.num_heads // self.num_kv_heads
            rows = q.reshape(num_prefills, self.num_kv_heads, group * query_len, self.head_size)
            row_mask = mask.repeat(1, 1, group, 1)  # [P, 1, group * max_query_len, max_seq_len]
            out = self._attend(rows, keys, values, row_mask, sinks).view(q.shape)
        return out.transpose(1, 2).reshape(-1, self.num_heads, self.head_size)[md.prefill_output_index]


class TorchSDPABackend(AttentionBackend):
    """Portable PyTorch paged attention; runs wherever PyTorch does."""

    name = "TORCH_SDPA"
    builder_cls = TorchSDPAMetadataBuilder
    impl_cls = TorchSDPAImpl
