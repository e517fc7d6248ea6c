"""Draft-model proposals: a small model with the target's vocabulary guesses k tokens.

The draft has its own paged KV cache, with as many blocks as the target's and addressed
by the same block tables and slot mapping, so the scheduler manages one set of blocks for
both (sized together: ``pagedllm.worker.kv_cache_sizing``). Each step:

1. ``forward_step``: the draft runs over the same tokens as the target (prompt chunks,
   last tokens and the drafts under verification), with the target's attention metadata,
   so its cache holds every position the target's does;
2. ``propose``: for each request that sampled, starting from its newest token at position
   P, k single-token steps write positions P .. P + k - 1 (the scheduler reserved these
   lookahead slots) and yield the drafts for P + 1 .. P + k. Slots of drafts that the
   target later rejects are overwritten by the next step, in both caches.

A row proposes greedily (a deterministic proposal, verified by
``rejection_sampler.num_accepted_matching``) or, given a temperature, samples each draft
from q = softmax(draft logits / temperature) and returns q for
``rejection_sampler.rejection_sample``. Either way the target's distribution is kept exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backends.abstract import AttentionMetadata, AttentionMetadataBuilder, AttentionBackend, CommonAttentionMetadata
from pagedllm.attention.metadata import set_forward_context
from pagedllm.attention.selector import get_attn_backend, set_attn_backend
from pagedllm.config import ModelConfig, SpeculativeConfig
from pagedllm.model_executor.layers.attention import Attention, bind_kv_caches
from pagedllm.model_executor.layers.sampler import greedy_sample
from pagedllm.model_executor.model_loader import get_model

logger = logging.getLogger(__name__)


@dataclass
class TargetStep:
    """What the target computed in a step, for a proposer that runs beside it
    (``forward_step``, called once the step's tokens are verified).

    Attributes:
        input_ids: [T] int64, the step's tokens.
        positions: [T] int64, their positions.
        next_token_ids: [T] int64, the token at position + 1 of each (the newly sampled
            token after a request's last known one; past a rejected draft, a stale one).
        hidden_states: [T, hidden], the target's last hidden states (after its final norm).
        metadata: the step's attention metadata (its slots are the draft's slots too).
        sample_indices: [R] int64, for each request that sampled, the index in T of its
            last accepted position (the position before its newest token).
        sample_rows: [R] int64, those requests' batch rows.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    next_token_ids: torch.Tensor
    hidden_states: torch.Tensor
    metadata: AttentionMetadata
    sample_indices: np.ndarray
    sample_rows: np.ndarray


class DraftModelProposer:
    """Loads the draft model and proposes k greedy tokens per request.

    Args:
        speculative_config: with ``draft_model_config`` set.
        block_size: tokens per KV-cache block (the target's).
        device: the target's device.
    """

    def __init__(self, speculative_config: SpeculativeConfig, block_size: int, device: torch.device) -> None:
        assert speculative_config.draft_model_config is not None
        self.model_config: ModelConfig = speculative_config.draft_model_config
        self.k = speculative_config.num_speculative_tokens
        self.block_size = block_size
        self.device = device

    def load_model(self, attn_backend: type[AttentionBackend], metadata_builder: AttentionMetadataBuilder) -> None:
        """Load the draft's weights with the target's attention backend (one metadata for
        both models); ``weights_bytes`` counts its parameters and buffers.

        Raises:
            ValueError: the backend cannot run the draft's head size, or loading fails.
        """
        get_attn_backend(self.model_config.head_dim, self.model_config.dtype, self.block_size, attn_backend.get_name())
        self.metadata_builder = metadata_builder
        with set_attn_backend(attn_backend):
            self.model = get_model(self.model_config, self.device)
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self.weights_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        logger.info("Draft model %s (%.1f MB), %d speculative tokens", self.model_config.model_path,
                    self.weights_bytes / 1e6, self.k)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the draft's ``num_blocks`` blocks per layer (the target's number)."""
        bind_kv_caches(self.attention_layers, num_blocks, self.block_size, self.model_config.dtype, self.device)

    def forward_step(self, step: TargetStep) -> None:
        """Write the KV of the step's tokens (the target's ids and positions) into the
        draft's cache, with the target's attention metadata."""
        with set_forward_context(step.metadata):
            self.model(step.input_ids, step.positions)

    def propose(self, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray, block_table: np.ndarray,
                temperature: np.ndarray) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
        """k drafts for each of batch ``rows``.

        Args:
            rows: [R] int64 batch rows whose newest token (at ``num_tokens[row] - 1``) is
                not yet in the draft's cache.
            token_ids: [max_num_reqs, max_model_len] int64 token ids of all rows.
            num_tokens: [max_num_reqs] int64 known tokens per row.
            block_table: [max_num_reqs, max_blocks] int64 block ids per row.
            temperature: [R] float32; 0 drafts greedily, else samples at that temperature.

        Returns:
            per row, its k drafts; and for each index i of ``rows`` that sampled, the
            [k, V] float32 distributions its drafts were drawn from.
        """
        last = num_tokens[rows] - 1
        ids = torch.from_numpy(token_ids[rows, last]).to(self.device)
        sampled = np.flatnonzero(temperature > 0)
        scale = self._to_device(temperature[sampled].astype(np.float32)).unsqueeze(1)
        drafts, probs = [], []
        for step in range(self.k):
            # Past max_model_len no draft can be verified: the last slot takes the writes.
            positions = np.minimum(last + step, self.model_config.max_model_len - 1)
            metadata = decode_metadata(self.metadata_builder, positions, block_table[rows], self.block_size)
            with set_forward_context(metadata):
                logits = self.model.compute_logits(self.model(ids, self._to_device(positions)))
            ids = greedy_sample(logits)
            if len(sampled):
                q = torch.softmax(logits[self._to_device(sampled)].float() / scale, dim=-1)
                ids[self._to_device(sampled)] = torch.multinomial(q, 1).squeeze(1)
                probs.append(q)
            drafts.append(ids)
        q_by_row = torch.stack(probs, dim=1) if probs else None
        return (torch.stack(drafts, dim=1).tolist(),
                {} if q_by_row is None else dict(zip(sampled.tolist(), q_by_row.unbind(0))))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)


def decode_metadata(builder: AttentionMetadataBuilder, positions: np.ndarray, block_table: np.ndarray,
                    block_size: int) -> AttentionMetadata:
    """Attention metadata for one token per request: request r's at ``positions[r]`` ([R]
    int64), whose KV goes to its slot in ``block_table[r]`` ([R, max_blocks] int64 block ids)."""
    width = int(positions.max()) // block_size + 1
    return builder.build(
        CommonAttentionMetadata(
            query_start_loc=np.arange(len(positions) + 1),
            seq_lens=positions + 1,
            num_computed_tokens=positions,
            block_table=block_table[:, :width],
            slot_mapping=block_table[np.arange(len(positions)), positions // block_size] * block_size
            + positions % block_size,
            num_decodes=len(positions),
        )
    )
