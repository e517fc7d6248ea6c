"""Draft-model proposals: a small model with the target's vocabulary guesses k tokens.

The draft has its own paged KV cache, with as many blocks as the target's and addressed
by the same block tables and slot mapping, so the scheduler manages one set of blocks for
both (sized together: ``pagedllm.worker.kv_cache_sizing``). The draft runs only for the
requests that propose (``num_speculative_tokens`` > 0 for them this step: with adaptive
speculation a request may skip drafting for many steps), and catches up lazily. Each step:

1. ``forward_step`` (once the target's step is verified): one forward of the draft over,
   per proposing request, the positions its cache lacks, up to its newest token at
   position N - 1, whose logits give its first draft: its whole prompt the first time
   (the draft's KV is never taken from the prefix cache: blocks that the target cached
   while the draft was skipped hold no draft KV), the tokens of the steps it skipped, and
   after a verifying step with m of k drafts accepted only the newest token (or, with all
   k accepted, the last draft and the newest token): positions that its own previous
   proposals wrote with the tokens now known, in the same slots, are not recomputed;
2. ``propose``: k - 1 single-token steps at positions N .. N + k - 2 yield drafts
   2 .. k (the scheduler reserved these lookahead slots). Slots of drafts that the target
   later rejects are rewritten by the next step, in both caches.

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
from pagedllm.attention.selector import get_attn_backend
from pagedllm.config import ModelConfig, SpeculativeConfig
from pagedllm.model_executor.layers.attention import Attention, bind_kv_caches
from pagedllm.model_executor.layers.sampler import Argmax
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
        token_ids: [max_num_reqs, max_model_len] int64, the batch's token ids (the step's
            accepted and newly sampled tokens appended).
        num_tokens: [max_num_reqs] int64, the batch's known tokens per row.
        block_table: [max_num_reqs, max_blocks] int64, the batch's block ids per row.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    next_token_ids: torch.Tensor
    hidden_states: torch.Tensor
    metadata: AttentionMetadata
    sample_indices: np.ndarray
    sample_rows: np.ndarray
    token_ids: np.ndarray
    num_tokens: np.ndarray
    block_table: np.ndarray


class DraftModelProposer:
    """Loads the draft model and proposes k greedy tokens per request.

    Args:
        speculative_config: with ``draft_model_config`` set.
        block_size: tokens per KV-cache block (the target's).
        device: the target's device.
        max_num_tokens: the most tokens one draft forward takes (the target's
            ``max_num_batched_tokens``).
    """

    def __init__(self, speculative_config: SpeculativeConfig, block_size: int, device: torch.device,
                 max_num_tokens: int) -> None:
        assert speculative_config.draft_model_config is not None
        self.model_config: ModelConfig = speculative_config.draft_model_config
        self.k = speculative_config.num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.greedy_sample = Argmax()
        # Per batch row: how many of its first positions the draft's cache holds (its known
        # tokens, in their slots); absent: none.
        self._cached: dict[int, int] = {}
        # Per batch row: the positions, slots and tokens its last proposal wrote into the
        # draft's cache past those ([n] int64 each), so ``forward_step`` skips those that hold.
        self._written: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # Per batch row that sampled in the last ``forward_step``: its index in _first_logits.
        self._first_rows: dict[int, int] = {}
        self._first_logits = torch.empty(0)

    def load_model(self, attn_backend: type[AttentionBackend], metadata_builder: AttentionMetadataBuilder) -> None:
        """Load the draft's weights with the target's attention backend (one metadata for
        both models); ``weights_bytes`` counts its parameters and buffers.

        Raises:
            ValueError: the backend cannot run the draft's head size, or loading fails.
        """
        get_attn_backend(self.model_config.head_dim, self.model_config.dtype, self.block_size, attn_backend.get_name(),
                         uses_sliding_window=self.model_config.sliding_window is not None)
        self.metadata_builder = metadata_builder
        self.model = get_model(self.model_config, self.device, attn_backend)
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self.weights_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        logger.info("Draft model %s (%.1f MB), %d speculative tokens", self.model_config.model_path,
                    self.weights_bytes / 1e6, self.k)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the draft's ``num_blocks`` blocks per layer (the target's number)."""
        bind_kv_caches(self.attention_layers, num_blocks, self.block_size, self.model_config.dtype, self.device)

    def forward_step(self, step: TargetStep, rows: np.ndarray) -> None:
        """Bring the draft's cache up to the known tokens of batch ``rows`` ([P] int64: the
        requests that propose after this step, all of which sampled in it) and keep the
        logits at each one's newest token (see the module docstring); other rows wait.
        Forwards take at most ``max_num_tokens`` tokens (a long catch-up, a whole prompt
        say, is split as a chunked prefill is)."""
        ends = step.num_tokens[rows]
        starts = np.fromiter((self._cached_upto(row, int(end) - 1, step) for row, end in zip(rows.tolist(), ends)),
                             dtype=np.int64, count=len(rows))
        first_rows: list[int] = []
        first_logits: list[torch.Tensor] = []
        while len(rows):
            # Shortest first: single-token requests lead (the metadata's decodes).
            order = np.argsort(ends - starts, kind="stable")
            rows, starts, ends = rows[order], starts[order], ends[order]
            left = ends - starts
            lens = np.minimum(left, np.maximum(self.max_num_tokens - (np.cumsum(left) - left), 0))
            taken = lens > 0
            hidden, cu = self._forward(step, rows[taken], starts[taken], lens[taken])
            starts = starts + lens
            done = starts == ends  # (rows not taken have starts < ends)
            first_rows += rows[done].tolist()
            first_logits.append(self.model.compute_logits(hidden[self._to_device(cu[done[taken]] - 1)]))
            self._cached.update(zip(rows[taken].tolist(), starts[taken].tolist()))
            rows, starts, ends = rows[~done], starts[~done], ends[~done]
        self._first_rows = {row: i for i, row in enumerate(first_rows)}
        if first_logits:
            self._first_logits = torch.cat(first_logits) if len(first_logits) > 1 else first_logits[0]

    def _forward(self, step: TargetStep, rows: np.ndarray, starts: np.ndarray,
                 lens: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """One draft forward over positions ``starts[i]`` .. + ``lens[i]`` of batch
        ``rows[i]`` ([n] int64 each); returns the hidden states [sum(lens), hidden] and the
        [n] cumulative token counts (row i's last token is at ``cu[i] - 1``)."""
        bs = self.block_size
        cu = np.cumsum(lens)
        token_req = np.repeat(np.arange(len(rows)), lens)
        positions = starts[token_req] + np.arange(int(cu[-1])) - (cu - lens)[token_req]
        token_rows = rows[token_req]
        seq_lens = starts + lens
        width = -(-int(seq_lens.max()) // bs)
        single = lens == 1
        metadata = self.metadata_builder.build(CommonAttentionMetadata(
            query_start_loc=np.concatenate(([0], cu)),
            seq_lens=seq_lens,
            num_computed_tokens=starts,
            block_table=step.block_table[rows, :width],
            slot_mapping=step.block_table[token_rows, positions // bs] * bs + positions % bs,
            num_decodes=len(lens) if single.all() else int(np.argmin(single)),
        ))
        with set_forward_context(metadata):
            hidden = self.model(self._to_device(step.token_ids[token_rows, positions]), self._to_device(positions))
        return hidden, cu

    def _cached_upto(self, row: int, end: int, step: TargetStep) -> int:
        """How many of ``row``'s first positions (at most ``end``) the draft's cache holds:
        those it computed, and after them those its last proposal wrote with the tokens
        now known there, into the slots they now have."""
        cached = min(self._cached.get(row, 0), end)
        written = self._written.pop(row, None)
        if written is None:
            return cached
        positions, slots, tokens = written
        n = min(len(positions), end - cached)
        if n <= 0 or positions[0] != cached:
            return cached
        now = positions[:n]
        now_slots = step.block_table[row, now // self.block_size] * self.block_size + now % self.block_size
        same = (step.token_ids[row, now] == tokens[:n]) & (now_slots == slots[:n])
        return cached + (n if same.all() else int(np.argmin(same)))

    def propose(self, rows: np.ndarray, num_drafts: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray,
                block_table: np.ndarray, temperature: np.ndarray) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
        """Drafts for each of batch ``rows`` (those of the last ``forward_step``).

        Args:
            rows: [R] int64 batch rows.
            num_drafts: [R] int64, how many drafts each row asks for (1 .. k).
            token_ids: [max_num_reqs, max_model_len] int64 token ids of all rows.
            num_tokens: [max_num_reqs] int64 known tokens per row.
            block_table: [max_num_reqs, max_blocks] int64 block ids per row.
            temperature: [R] float32; 0 drafts greedily, else samples at that temperature.

        Returns:
            per row, its ``num_drafts`` drafts; and for each index i of ``rows`` that
            sampled, the [num_drafts[i], V] float32 distributions its drafts were drawn from.
        """
        newest = num_tokens[rows] - 1
        logits = self._first_logits[self._to_device(np.array([self._first_rows[r] for r in rows.tolist()]))]
        sampled = np.flatnonzero(temperature > 0)
        sampled_t = self._to_device(sampled)
        scale = self._to_device(temperature[sampled].astype(np.float32)).unsqueeze(1)
        drafts, probs = [], []
        for step in range(int(num_drafts.max())):
            if step:
                # Past max_model_len no draft can be verified: the last slot takes the writes.
                positions = np.minimum(newest + step, self.model_config.max_model_len - 1)
                metadata = decode_metadata(self.metadata_builder, positions, block_table[rows], self.block_size)
                with set_forward_context(metadata):
                    logits = self.model.compute_logits(self.model(ids, self._to_device(positions)))
            ids = self.greedy_sample(logits)
            if len(sampled):
                q = torch.softmax(logits[sampled_t].float() / scale, dim=-1)
                ids[sampled_t] = torch.multinomial(q, 1).squeeze(1)
                probs.append(q)
            drafts.append(ids)
        draft_ids = torch.stack(drafts, dim=1).numpy(force=True)
        self._remember_written(rows, newest, draft_ids, block_table)
        q_by_row = torch.stack(probs, dim=1).unbind(0) if probs else ()
        return ([row[:n] for row, n in zip(draft_ids.tolist(), num_drafts.tolist())],
                {i: q_by_row[j][: num_drafts[i]] for j, i in enumerate(sampled.tolist())})

    def _remember_written(self, rows: np.ndarray, newest: np.ndarray, draft_ids: np.ndarray,
                          block_table: np.ndarray) -> None:
        """Record what the draft's cache now holds past each row's known tokens (up to
        ``newest``): drafts 1 .. d - 1 ([R, d] ``draft_ids``) after it, the last slot before
        max_model_len excepted (clamped writes land there)."""
        bs = self.block_size
        width = draft_ids.shape[1]
        for i, row in enumerate(rows.tolist()):
            positions = np.arange(newest[i] + 1, min(newest[i] + width, self.model_config.max_model_len - 1))
            slots = block_table[row, positions // bs] * bs + positions % bs
            self._written[row] = (positions, slots, draft_ids[i, : len(positions)])

    def discard(self, row: int) -> None:
        """Forget what the draft's cache holds for batch ``row`` (its request is gone)."""
        self._written.pop(row, None)
        self._cached.pop(row, None)

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
