"""Per-step attention metadata: one typed object, set by the model runner, read by every
attention layer through ``get_forward_context()`` (so ``model.forward(input_ids, positions)``
carries no plumbing).

Token order in a step: the ``num_decodes`` decode requests come first, one query token
each; then the prefill requests (query length > 1, possibly a chunk of a longer prompt),
each a contiguous run of tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to.

    Attributes:
        slot_mapping: [num_tokens] int64; cache slot of each token
            (``block_id * block_size + offset``) where its K/V is written.
        num_decodes: number of requests with exactly one query token (the first tokens).
        decode_block_table: [num_decodes, max_blocks] int64 block tables (padded with 0).
        decode_seq_lens: [num_decodes] int64 tokens in context including the new one.
        prefill_query_start_loc: [num_prefills + 1] token offsets (Python ints) of each
            prefill request's queries, counted from the first prefill token.
        prefill_seq_lens: [num_prefills] context lengths (Python ints) including the chunk.
        prefill_block_table: [num_prefills, max_blocks] int64 block tables (padded with 0).
        prefill_token_block_table, prefill_token_seq_lens: the prefill tokens seen as decode
            queries: [num_prefill_tokens, max_blocks] int64 (each token's request's block
            table) and [num_prefill_tokens] int64 (its position + 1: the causal context,
            cached tokens included). Set only when the backend attends prefills with the
            CPU decode kernel (``ModelRunner`` with the C++ kernels), else None.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_table: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_query_start_loc: list[int]
    prefill_seq_lens: list[int]
    prefill_block_table: torch.Tensor
    prefill_token_block_table: Optional[torch.Tensor] = None
    prefill_token_seq_lens: Optional[torch.Tensor] = None

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_seq_lens)


_forward_context: Optional[AttentionMetadata] = None


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Make ``metadata`` visible to attention layers for one forward pass.

    Raises:
        RuntimeError: if a forward context is already set (contexts do not nest).
    """
    global _forward_context
    if _forward_context is not None:
        raise RuntimeError("set_forward_context does not nest; a forward pass is already running.")
    _forward_context = metadata
    try:
        yield
    finally:
        _forward_context = None


def get_forward_context() -> AttentionMetadata:
    """The metadata of the forward pass in progress.

    Raises:
        RuntimeError: outside ``set_forward_context``.
    """
    if _forward_context is None:
        raise RuntimeError("No forward context: call the model inside set_forward_context().")
    return _forward_context
