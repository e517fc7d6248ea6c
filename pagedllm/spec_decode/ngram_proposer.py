"""n-gram proposals (prompt lookup decoding): copy what followed an earlier occurrence of
the sequence's last tokens.

Saxena, "Prompt Lookup Decoding" (2023), as vLLM's ``method: "ngram"``: with
``prompt_lookup_min`` <= n <= ``prompt_lookup_max``, the longest n for which the last n
tokens of prompt + output occurred before, at their first (earliest) occurrence, proposes
the up to k tokens that followed it (vLLM's ``NgramProposer``: the longest match, and of
those the earliest). No model runs: the search is ``bytes.find`` (C) over the token ids'
bytes, a few microseconds per request, done on the host every step.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to the asked number of tokens per request by n-gram lookup.

    Args:
        prompt_lookup_min: the shortest suffix matched (tokens).
        prompt_lookup_max: the longest suffix matched (tokens).
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_one(self, tokens: np.ndarray, max_tokens: int) -> list[int]:
        """The proposal for one sequence ``tokens`` ([L] integer ids, prompt then output,
        contiguous): up to ``max_tokens`` tokens, empty when no suffix of
        ``prompt_lookup_min`` tokens or more recurs."""
        last = len(tokens) - 1
        # An earlier occurrence lies within tokens[:last] (it ends before the last token).
        # A byte match counts only at a multiple of the item size (a whole token).
        earlier = tokens[:last].tobytes()
        size = tokens.itemsize
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            suffix = tokens[last + 1 - n :].tobytes()
            at = earlier.find(suffix)
            while at > 0 and at % size:
                at = earlier.find(suffix, at + 1)
            if at >= 0:
                follow = at // size + n
                return tokens[follow : follow + max_tokens].tolist()
        return []

    def propose(self, rows: np.ndarray, num_drafts: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray,
                block_table: np.ndarray, temperature: np.ndarray) -> tuple[list[list[int]], dict]:
        """Proposals of up to ``num_drafts[i]`` ([R] int64) tokens for batch ``rows[i]`` of
        ``token_ids`` ([R, max_model_len] int64, the first ``num_tokens[row]`` of each row
        known); ``block_table`` and ``temperature`` are not used (the proposers' common
        signature: n-gram proposals are deterministic, so no draft distributions are
        returned)."""
        return [self.propose_one(token_ids[row, : num_tokens[row]], n)
                for row, n in zip(rows.tolist(), num_drafts.tolist())], {}
