"""EAGLE / EAGLE-3 proposals: a one-layer head that reads the target's hidden states guesses
k tokens (Li et al. 2024, 2025; vLLM's ``method: "eagle"`` / ``"eagle3"``).

The head (``pagedllm.model_executor.models.llama_eagle``) has its own paged KV cache, sized
with the target's and addressed by the same block tables, as a draft model's
(``DraftModelProposer``, whose loading and cache this class shares). At position p it reads
the token at p + 1 and the target's feature at p (EAGLE-1: the last hidden state; EAGLE-3:
the inputs of three target layers, ``SpeculativeConfig.eagle_aux_hidden_state_layer_ids``).
Each step:

1. ``forward_step`` (after the target's step is verified, so every position's next token is
   known): the head runs over the step's positions with the tokens shifted by one and the
   target's features, writing its KV, for every request (it needs the target's features,
   which only this step has, so it cannot skip steps as a draft model does); at the last
   accepted position P = N - 2 (N known tokens) of each request that proposes after the
   step it yields the first draft (for position N) and its own feature;
2. ``propose``: k - 1 single-token steps at positions N - 1 .. N + k - 3, each reading the
   previous draft and the head's previous feature, yield drafts 2 .. k. Positions past
   the newest token hold guesses and are rewritten by the next step.

Drafts are the head's argmax (as vLLM), mapped to target ids by an EAGLE-3 head's ``d2t``;
the rejection sampler verifies them as deterministic proposals, so greedy output is the
target's and sampled output keeps the target's distribution.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backends.abstract import AttentionBackend, AttentionMetadataBuilder
from pagedllm.attention.metadata import set_forward_context
from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.draft_model import DraftModelProposer, TargetStep, decode_metadata


class EagleProposer(DraftModelProposer):
    """Loads an EAGLE / EAGLE-3 head and proposes k greedy tokens per request.

    Args:
        speculative_config: method "eagle" or "eagle3", with ``draft_model_config`` set.
        block_size: tokens per KV-cache block (the target's).
        device: the target's device.
        max_num_tokens: as ``DraftModelProposer``'s (the head runs over the target's steps,
            which never exceed it).
    """

    def __init__(self, speculative_config: SpeculativeConfig, block_size: int, device: torch.device,
                 max_num_tokens: int) -> None:
        super().__init__(speculative_config, block_size, device, max_num_tokens)
        self.aux_layers = speculative_config.eagle_aux_hidden_state_layer_ids
        # Per batch row that sampled in the last ``forward_step`` (``_first_rows``): its first
        # draft and the head's feature for the next position.
        self._first_ids = torch.empty(0, dtype=torch.int64)
        self._first_hidden = torch.empty(0)

    def load_model(self, attn_backend: type[AttentionBackend], metadata_builder: AttentionMetadataBuilder,
                   target: torch.nn.Module) -> None:
        """Load the head (``DraftModelProposer.load_model``), give it ``target``'s
        embeddings (and, EAGLE-1, lm_head), and have ``target`` keep an EAGLE-3 head's
        layer inputs at each forward (``set_aux_hidden_state_layers``).

        Raises:
            ValueError: as ``DraftModelProposer.load_model``.
        """
        super().load_model(attn_backend, metadata_builder)
        self.model.bind_target(target)
        self.target = target
        if self.aux_layers:
            target.set_aux_hidden_state_layers(self.aux_layers)

    def forward_step(self, step: TargetStep, rows: np.ndarray) -> None:
        """Run the head over the step's positions (see the module docstring) and keep the
        first draft of each of batch ``rows`` ([P] int64: the requests that propose after
        this step, all of which sampled in it)."""
        if self.aux_layers:
            features = torch.cat(self.target.aux_hidden_states, dim=-1)
        else:
            features = step.hidden_states
        with set_forward_context(step.metadata):
            normed, hidden = self.model(step.next_token_ids, step.positions, self.model.combine_hidden_states(features))
        proposing = np.isin(step.sample_rows, rows)
        index = self._to_device(step.sample_indices[proposing])
        self._first_rows = {row: i for i, row in enumerate(step.sample_rows[proposing].tolist())}
        self._first_ids = self._draft_ids(normed[index])
        self._first_hidden = hidden[index]

    def propose(self, rows: np.ndarray, num_drafts: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray,
                block_table: np.ndarray, temperature: np.ndarray) -> tuple[list[list[int]], dict]:
        """Drafts for each of batch ``rows`` (those of the last ``forward_step``).

        Args:
            rows: [R] int64 batch rows.
            num_drafts: [R] int64, how many drafts each row asks for (1 .. k).
            token_ids: [max_num_reqs, max_model_len] int64 token ids of all rows (not used:
                the drafts follow from ``forward_step``).
            num_tokens: [max_num_reqs] int64 known tokens per row.
            block_table: [max_num_reqs, max_blocks] int64 block ids per row.
            temperature: not used (drafts are the head's argmax whatever the request samples).

        Returns:
            per row, its ``num_drafts`` drafts; and no draft distributions (deterministic
            proposals).
        """
        first = self._to_device(np.array([self._first_rows[row] for row in rows.tolist()], dtype=np.int64))
        ids, hidden = self._first_ids[first], self._first_hidden[first]
        drafts = [ids]
        for step in range(1, int(num_drafts.max())):
            # Past max_model_len no draft can be verified: the last slot takes the writes.
            positions = np.minimum(num_tokens[rows] - 2 + step, self.model_config.max_model_len - 1)
            metadata = decode_metadata(self.metadata_builder, positions, block_table[rows], self.block_size)
            with set_forward_context(metadata):
                normed, hidden = self.model(ids, self._to_device(positions), hidden)
            ids = self._draft_ids(normed)
            drafts.append(ids)
        return [row[:n] for row, n in zip(torch.stack(drafts, dim=1).tolist(), num_drafts.tolist())], {}

    def _draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, hidden] head outputs -> [N] int64 target token ids of their argmax."""
        ids = self.greedy_sample(self.model.compute_logits(normed))
        d2t = self.model.draft_id_to_target_id
        return ids if d2t is None else ids + d2t[ids]
