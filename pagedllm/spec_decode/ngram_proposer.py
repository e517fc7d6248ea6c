"""n-gram proposals (prompt lookup decoding): copy what followed an earlier occurrence of
the sequence's last tokens.

Saxena, "Prompt Lookup Decoding" (2023), as vLLM's ``method: "ngram"``: with
``prompt_lookup_min`` <= n <= ``prompt_lookup_max``, the longest n for which the last n
tokens of prompt + output occurred before, at their first (earliest) occurrence, proposes
the up to k tokens that followed it. No model runs; numpy on the host.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` tokens per request by n-gram lookup.

    Args:
        num_speculative_tokens: k, the most tokens proposed.
        prompt_lookup_min: the shortest suffix matched (tokens).
        prompt_lookup_max: the longest suffix matched (tokens).
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_one(self, tokens: np.ndarray) -> list[int]:
        """The proposal for one sequence ``tokens`` ([L] int64, prompt then output): up to
        k tokens, empty when no suffix of ``prompt_lookup_min`` tokens or more recurs."""
        num_tokens = len(tokens)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. L - n - 1: every occurrence but the suffix itself.
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[num_tokens - n:]).all(axis=1))
            if len(starts):
                follow = int(starts[0]) + n
                return tokens[follow : follow + self.k].tolist()
        return []

    def propose(self, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray, block_table: np.ndarray,
                temperature: np.ndarray) -> tuple[list[list[int]], dict]:
        """Proposals for batch ``rows`` of ``token_ids`` ([R, max_model_len] int64, the
        first ``num_tokens[row]`` of each row known); ``block_table`` and ``temperature`` are
        not used (the proposers' common signature: n-gram proposals are deterministic, so no
        draft distributions are returned)."""
        return [self.propose_one(token_ids[row, : num_tokens[row]]) for row in rows.tolist()], {}
