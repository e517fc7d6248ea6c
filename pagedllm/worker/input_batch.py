"""The model runner's persistent batch: one row per request it holds, kept across steps.

Token ids and block tables (one per KV-cache group: ``pagedllm.core.kv_cache_interface``)
live in preallocated numpy arrays so each step's inputs are built by vectorised indexing
instead of per-token Python loops. A request is added once
(or again after a preemption) and then only updated with diffs.

The requests' sampling settings live here too, per row (numpy columns, plus sparse dicts
for the rare per-request extras: logit bias, min_tokens, seeds). ``sampling_metadata``
turns them into the sampler's ``SamplingMetadata`` for the rows sampled in a step, and
keeps it while the batch stays the same, for each of the last few row lists (speculative
decoding samples a request at 1 + k positions, k changing from step to step): a steady
decode batch rebuilds nothing, only the per-step seeds and min_tokens rows are refreshed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedllm.lora.request import LoRARequest
from pagedllm.messages.sched_output import NewRequestData
from pagedllm.model_executor.sampling_metadata import SamplingMetadata, disallowed_token_mask, min_tokens_blocked_ids
from pagedllm.sampling_params import _GREEDY_TEMPERATURE, SamplingParams


#: Sampling views kept per batch version: enough for a request sampled at 1 .. 1 + k positions
#: (k <= 7), the row lists of a speculative batch-1 decode.
_MAX_VIEWS = 8


def seed_for_step(seed: int, num_output_tokens: int) -> int:
    """A generator seed that depends only on the request's seed and its output position, so
    a seeded request samples the same tokens whatever its batch, and after a preemption."""
    return (seed * 0x9E3779B97F4A7C15 + num_output_tokens) % (2**63)


@dataclass
class CachedRequestState:
    """What the runner remembers of one request (besides its numpy row)."""

    req_id: str
    row: int
    num_prompt_tokens: int
    output_token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: Optional[LoRARequest] = None


@dataclass
class _SamplingView:
    """A ``SamplingMetadata`` for given rows, with what each step refreshes in it.

    ``seeded`` lists (metadata row, generator, request seed); ``min_tokens`` lists
    (metadata row, min_tokens, blocked ids); ``outputs`` are the rows' output token lists
    (the requests' own lists, which grow in place), for penalties and bad words only.
    """

    rows: np.ndarray
    metadata: SamplingMetadata
    seeded: list[tuple[int, torch.Generator, int]]
    min_tokens: list[tuple[int, int, set[int]]]
    outputs: list[list[int]]


class InputBatch:
    """Rows of token ids [max_num_reqs, max_model_len] and, per KV-cache group, block tables
    [max_num_reqs, max_blocks_per_req] (``block_tables[g]``; ``block_table`` is group 0's;
    neither for an encoder, which has no group), all int64 numpy arrays, and the rows'
    sampling settings."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device,
                 num_kv_cache_groups: int = 1) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = [np.zeros((max_num_reqs, max_blocks), dtype=np.int64) for _ in range(num_kv_cache_groups)]
        self.block_table = self.block_tables[0] if self.block_tables else None
        # Blocks in each row's table, per group: [num_kv_cache_groups, max_num_reqs].
        self.num_blocks = np.zeros((num_kv_cache_groups, max_num_reqs), dtype=np.int64)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self._init_sampling_state(max_num_reqs)

    def _init_sampling_state(self, max_num_reqs: int) -> None:
        """Per-row sampling columns (see ``SamplingMetadata``; 0.0 temperature = greedy,
        top_k 0 = off, -1 logprobs = none) and sparse row -> value dicts."""
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalties = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalties = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalties = np.ones(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.logit_bias: dict[int, dict[int, float]] = {}
        self.allowed_token_ids: dict[int, list[int]] = {}
        self.bad_words_token_ids: dict[int, list[list[int]]] = {}
        self.min_tokens: dict[int, tuple[int, set[int]]] = {}
        self.generators: dict[int, tuple[torch.Generator, int]] = {}
        self.output_token_ids: dict[int, list[int]] = {}
        # Bumped whenever a row changes hands: the cached views are stale after it.
        self._version = 0
        # The views of the current version, by their rows' bytes (at most _MAX_VIEWS).
        self._views: dict[bytes, _SamplingView] = {}
        self._views_version = 0

    def add_request(self, new: NewRequestData) -> None:
        """Give a new (or resumed) request a row.

        Raises:
            RuntimeError: if every row is taken (more running requests than max_num_seqs).
        """
        if not self._free_rows:
            raise RuntimeError("InputBatch is full: more running requests than max_num_seqs.")
        row = self._free_rows.pop()
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[:, row] = 0
        self.append_block_ids(row, new.block_ids)
        state = CachedRequestState(
            req_id=new.req_id,
            row=row,
            num_prompt_tokens=new.num_prompt_tokens,
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            lora_request=new.lora_request,
        )
        self.requests[new.req_id] = state
        self._add_sampling_state(row, state, new.eos_token_id)

    def _add_sampling_state(self, row: int, state: CachedRequestState, eos_token_id: Optional[int]) -> None:
        params = state.sampling_params
        self.temperature[row] = 0.0 if params.is_greedy else params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = max(params.top_k, 0)
        self.min_p[row] = params.min_p
        self.presence_penalties[row] = params.presence_penalty
        self.frequency_penalties[row] = params.frequency_penalty
        self.repetition_penalties[row] = params.repetition_penalty
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        if params.logit_bias:
            self.logit_bias[row] = params.logit_bias
        if params.allowed_token_ids:
            self.allowed_token_ids[row] = params.allowed_token_ids
        if params.bad_words_token_ids:
            self.bad_words_token_ids[row] = params.bad_words_token_ids
        if params.min_tokens > 0:
            self.min_tokens[row] = (params.min_tokens, min_tokens_blocked_ids(params, eos_token_id))
        if params.seed is not None:
            self.generators[row] = (torch.Generator(device=self.device), params.seed)
        self.output_token_ids[row] = state.output_token_ids
        self._version += 1

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is None:
            return
        row = state.row
        for sparse in (self.logit_bias, self.allowed_token_ids, self.bad_words_token_ids, self.min_tokens,
                       self.generators, self.output_token_ids):
            sparse.pop(row, None)
        self._free_rows.append(row)
        self._version += 1

    def append_block_ids(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Append to ``row``'s table of each group g the ids ``block_ids[g]``."""
        for table, num_blocks, ids in zip(self.block_tables, self.num_blocks, block_ids):
            start = num_blocks[row]
            table[row, start : start + len(ids)] = ids
            num_blocks[row] = start + len(ids)

    def append_token(self, state: CachedRequestState, token_id: int) -> None:
        row = state.row
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1
        state.output_token_ids.append(token_id)

    def write_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        """Put ``token_ids`` at positions ``start`` .. of ``row`` (known tokens a stage
        before the last did not sample: ``CachedRequestData.new_token_ids``)."""
        end = start + len(token_ids)
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = max(int(self.num_tokens[row]), end)

    def draft_temperature(self, rows: np.ndarray) -> np.ndarray:
        """[R] float32 per row: the temperature at which a draft model samples its drafts,
        0 to draft greedily. Greedy and seeded requests draft greedily (so a seeded request
        gives the tokens it gives without speculation: ``spec_decode.rejection_sampler``)."""
        if not self.generators:
            return self.temperature[rows]
        seeded = np.isin(rows, np.fromiter(self.generators, dtype=np.int64, count=len(self.generators)))
        return np.where(seeded, 0.0, self.temperature[rows]).astype(np.float32)

    # ------------------------------------------------------------------ sampling
    def sampling_metadata(self, rows: np.ndarray, num_output_tokens: np.ndarray,
                          vocab_size: int) -> SamplingMetadata:
        """The sampler's metadata for one sampled position per entry of ``rows``.

        Reused from an earlier step when no request was added or removed since and
        ``rows`` are the same (one of the last ``_MAX_VIEWS`` row lists); its seeds,
        min_tokens rows and (for penalties) output tokens are then refreshed from
        ``num_output_tokens``.

        Args:
            rows: [S] int64 batch rows, in sampling order; a row appears once per position
                sampled for its request (several for speculative decoding), consecutively.
            num_output_tokens: [S] int64, per entry the number of output tokens before the
                sampled one (it sets the seeded rows' seed, min_tokens and penalties).
            vocab_size: V, the logits' last dimension.

        Returns:
            a ``SamplingMetadata`` whose row j describes entry j (tensors on the batch's
            device); valid until the next call.
        """
        if self._views_version != self._version:
            self._views.clear()
            self._views_version = self._version
        key = rows.astype(np.int64, copy=False).tobytes()
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            view = self._views[key] = self._make_view(rows, vocab_size)
        metadata = view.metadata
        for j, generator, seed in view.seeded:
            generator.manual_seed(seed_for_step(seed, int(num_output_tokens[j])))
        if view.min_tokens:
            metadata.min_tokens = {j: (m, blocked) for j, m, blocked in view.min_tokens
                                   if num_output_tokens[j] < m}
        if view.outputs:
            metadata.output_token_ids = [
                self._outputs_before(out, row, n)
                for out, row, n in zip(view.outputs, view.rows.tolist(), num_output_tokens.tolist())
            ]
        return metadata

    def _outputs_before(self, outputs: list[int], row: int, n: int) -> list[int]:
        """The first ``n`` output tokens of ``row``: its ``outputs`` list, continued by the
        draft tokens written after them (a position past a draft, speculative decoding)."""
        if n <= len(outputs):
            return outputs if n == len(outputs) else outputs[:n]
        start = int(self.num_prompt_tokens[row]) + len(outputs)
        return outputs + self.token_ids[row, start : start + n - len(outputs)].tolist()

    def _make_view(self, rows: np.ndarray, vocab_size: int) -> _SamplingView:
        """Gather the rows' sampling columns into a new ``SamplingMetadata``."""
        temperature = self.temperature[rows]
        greedy = temperature < _GREEDY_TEMPERATURE
        top_p, top_k, min_p = self.top_p[rows], self.top_k[rows], self.min_p[rows]
        penalties = [self.presence_penalties[rows], self.frequency_penalties[rows],
                     self.repetition_penalties[rows]]
        no_penalties = not (penalties[0].any() or penalties[1].any() or (penalties[2] != 1.0).any())
        num_logprobs = int(self.num_logprobs[rows].max()) if len(rows) else -1
        row_list = rows.tolist()
        metadata = SamplingMetadata(
            temperature=self._to_device(temperature),
            all_greedy=bool(greedy.all()),
            all_random=not greedy.any(),
            top_p=self._to_device(top_p) if (top_p < 1.0).any() else None,
            top_k=self._to_device(np.where(top_k > 0, top_k, vocab_size)) if top_k.any() else None,
            min_p=self._to_device(min_p) if min_p.any() else None,
            generators={},
            no_penalties=no_penalties,
            presence_penalties=self._to_device(penalties[0]),
            frequency_penalties=self._to_device(penalties[1]),
            repetition_penalties=self._to_device(penalties[2]),
            prompt_token_ids=None if no_penalties else self._padded_prompts(rows, vocab_size),
            output_token_ids=[[] for _ in row_list],
            min_tokens={},
            logit_bias=[self.logit_bias.get(row) for row in row_list] if self.logit_bias else [None] * len(row_list),
            max_num_logprobs=num_logprobs if num_logprobs >= 0 else None,
            disallowed_token_mask=(disallowed_token_mask([self.allowed_token_ids.get(row) for row in row_list],
                                                         vocab_size, self.device)
                                   if self.allowed_token_ids else None),
            bad_words_token_ids={j: self.bad_words_token_ids[row] for j, row in enumerate(row_list)
                                 if row in self.bad_words_token_ids},
        )
        seeded = []
        for row, (generator, seed) in self.generators.items():
            for k, j in enumerate(np.flatnonzero(rows == row).tolist()):
                # NOTE: further positions of a request need generators of their own; each
                # is seeded for its own output position, every step.
                gen = generator if k == 0 else torch.Generator(device=self.device)
                metadata.generators[j] = gen
                seeded.append((j, gen, seed))
        min_tokens = [(j, m, blocked) for row, (m, blocked) in self.min_tokens.items()
                      for j in np.flatnonzero(rows == row).tolist()]
        needs_outputs = not no_penalties or metadata.bad_words_token_ids
        outputs = [self.output_token_ids[row] for row in row_list] if needs_outputs else []
        return _SamplingView(rows.copy(), metadata, seeded, min_tokens, outputs)

    def _padded_prompts(self, rows: np.ndarray, vocab_size: int) -> torch.Tensor:
        """[S, max_prompt_len] int64 prompt ids of ``rows``, padded with ``vocab_size``."""
        num_prompt = self.num_prompt_tokens[rows]
        width = int(num_prompt.max())
        ids = self.token_ids[rows, :width]
        ids[np.arange(width) >= num_prompt[:, None]] = vocab_size
        return self._to_device(ids)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)
