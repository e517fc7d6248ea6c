"""``TORCH_MLA``: multi-head latent attention (DeepSeek-V2 / V3's MLA) over a paged cache
of compressed latents, in portable PyTorch (vLLM's ``MLACommonImpl`` scheme).

The cache holds, per token and layer, one "head" of ``kv_lora_rank + qk_rope_head_dim``
values: the normalised latent ``kv_c`` and the rotated shared rope key ``k_pe``::

    kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]

The up-projection ``kv_b_proj`` ([H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]: W_UK
and W_UV per head) turns a latent into per-head keys (no-rope part) and values:

- prefills decompress their gathered contexts through ``kv_b_proj`` each step, and attend
  with keys ``[k_nope | k_pe]`` and values as ordinary multi-head attention (causal mask
  offset by the cached length, as ``TORCH_SDPA``);
- decodes absorb W_UK into the query (``q_nope @ W_UK``: a query in latent space), attend
  over the latents themselves (one KV head shared by every query head, MQA), and apply W_UV
  to the latent output: the same scores and output in exact arithmetic, without expanding
  the context.

The metadata (block tables, masks, padded query rows) is ``TORCH_SDPA``'s builder's. The
cache is the model's dtype (no FP8), and ``--batch-invariant`` is not built for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend, AttentionImpl
from pagedllm.attention.backends.torch_sdpa import TorchSDPAMetadata, TorchSDPAMetadataBuilder
from pagedllm.attention.paged_kv_cache import gather_context


class TorchMLAImpl(AttentionImpl[TorchSDPAMetadata]):
    """MLA over the latent cache. ``head_size`` is the cache's width (kv_lora_rank +
    qk_rope_head_dim), ``num_kv_heads`` 1; the layer supplies the rest (``forward``)."""

    def forward(self, layer: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        """Write this step's latents into ``kv_cache`` at ``attn_metadata.slot_mapping``, then
        attend (each query over its request's context up to itself).

        Args:
            layer: the calling ``MLAAttention`` (its ``kv_lora_rank``, ``qk_nope_head_dim``,
                ``v_head_dim`` and ``kv_b_proj``).
            query: [T, H, qk_nope_head_dim + qk_rope_head_dim], the rope part rotated.
            key: [T, kv_lora_rank], the normalised latents ``kv_c``.
            value: [T, qk_rope_head_dim], the rotated rope keys ``k_pe``.
            kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].

        Returns:
            [T, H, v_head_dim] in the query's dtype.

        Raises:
            ValueError: per-token (``--batch-invariant``) metadata.
        """
        if attn_metadata.token_seq_lens is not None:
            raise ValueError("TORCH_MLA has no batch-invariant mode (--batch-invariant).")
        latent = torch.cat((key, value), dim=-1)
        kv_cache.view(-1, latent.shape[-1]).index_copy_(0, attn_metadata.slot_mapping, latent)
        num_decodes = attn_metadata.num_decodes
        output = query.new_empty(query.shape[0], self.num_heads, layer.v_head_dim)
        if num_decodes:
            output[:num_decodes] = self._decode(layer, query[:num_decodes], kv_cache, attn_metadata)
        if attn_metadata.num_prefills:
            output[num_decodes:] = self._prefill(layer, query[num_decodes:], kv_cache, attn_metadata)
        return output

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, valid: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """[B, L, kv_lora_rank + qk_rope_head_dim] latents of each context, zero past it."""
        return gather_context(kv_cache.unsqueeze(2), block_table, valid, dtype)[:, 0]

    def _decode(self, layer: nn.Module, query: torch.Tensor, kv_cache: torch.Tensor,
                md: TorchSDPAMetadata) -> torch.Tensor:
        """[N, H, qk_head_dim] decode queries -> [N, H, v_head_dim], by weight absorption."""
        w_uk, w_uv = layer.absorbed_weights(query.dtype)
        nope = layer.qk_nope_head_dim
        q_latent = torch.einsum("nhd,hdl->nhl", query[..., :nope], w_uk)
        q = torch.cat((q_latent, query[..., nope:]), dim=-1)  # [N, H, L + R]
        context = self._gather(kv_cache, md.decode_block_table, md.decode_valid, query.dtype)  # [N, len, L + R]
        # NOTE: explicit products: one KV head of width L + R, values of width L (SDPA's
        # general path is slower here on CPU).
        scores = torch.bmm(q, context.transpose(1, 2)).mul_(self.scale)
        scores.masked_fill_(~md.decode_valid[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.bmm(probs, context[..., : layer.kv_lora_rank])  # [N, H, kv_lora_rank]
        return torch.einsum("nhl,hvl->nhv", out, w_uv)

    def _prefill(self, layer: nn.Module, query: torch.Tensor, kv_cache: torch.Tensor,
                 md: TorchSDPAMetadata) -> torch.Tensor:
        """[num_prefill_tokens, H, qk_head_dim] queries -> [.., H, v_head_dim], over contexts
        decompressed through ``kv_b_proj``."""
        assert md.prefill_block_table is not None and md.prefill_valid is not None
        assert md.prefill_query_index is not None and md.prefill_mask is not None
        assert md.prefill_output_index is not None
        context = self._gather(kv_cache, md.prefill_block_table, md.prefill_valid, query.dtype)  # [P, L, W]
        num_prefills, length, _ = context.shape
        nope, rank = layer.qk_nope_head_dim, layer.kv_lora_rank
        kv = layer.kv_b_proj(context[..., :rank].reshape(-1, rank)).view(num_prefills, length, self.num_heads, -1)
        k_pe = context[:, :, None, rank:].expand(-1, -1, self.num_heads, -1)
        keys = torch.cat((kv[..., :nope], k_pe), dim=-1).transpose(1, 2)  # [P, H, L, qk_head_dim]
        values = kv[..., nope:].transpose(1, 2)  # [P, H, L, v_head_dim]
        q = query[md.prefill_query_index].transpose(1, 2)  # [P, H, max_query_len, qk_head_dim]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=md.prefill_mask, scale=self.scale)
        return out.transpose(1, 2).reshape(-1, self.num_heads, layer.v_head_dim)[md.prefill_output_index]


class TorchMLABackend(AttentionBackend):
    """Portable PyTorch MLA over a latent cache; runs wherever PyTorch does."""

    name = "TORCH_MLA"
    builder_cls = TorchSDPAMetadataBuilder
    impl_cls = TorchMLAImpl

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @staticmethod
    def get_supported_kv_cache_dtypes() -> tuple[str, ...]:
        return ("auto",)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """``[num_blocks, block_size, head_size]``: one latent of ``head_size`` (kv_lora_rank
        + qk_rope_head_dim) per token; ``num_kv_heads`` must be 1.

        Raises:
            ValueError: ``num_kv_heads`` other than 1.
        """
        if num_kv_heads != 1:
            raise ValueError(f"An MLA cache holds one latent per token (num_kv_heads 1), got {num_kv_heads}.")
        return (num_blocks, block_size, head_size)
