"""The model runner's persistent batch: one row per request it holds, kept across steps.

Token ids and block tables live in preallocated numpy arrays so each step's inputs are
built by vectorised indexing instead of per-token Python loops. A request is added once
(or again after a preemption) and then only updated with diffs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedllm.messages.sched_output import NewRequestData
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner remembers of one request (besides its numpy row)."""

    req_id: str
    row: int
    num_prompt_tokens: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    generator: Optional[torch.Generator]


class InputBatch:
    """Rows of token ids [max_num_reqs, max_model_len] and block tables
    [max_num_reqs, max_blocks_per_req], both int64 numpy arrays."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

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
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, new.block_ids)
        params = new.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            row=row,
            num_prompt_tokens=new.num_prompt_tokens,
            prompt_token_ids=new.token_ids[: new.num_prompt_tokens],
            output_token_ids=list(new.output_token_ids),
            sampling_params=params,
            eos_token_id=new.eos_token_id,
            generator=generator,
        )

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, state: CachedRequestState, token_id: int) -> None:
        row = state.row
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1
        state.output_token_ids.append(token_id)
