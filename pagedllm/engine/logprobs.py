"""Sample and prompt logprobs of one request, from engine lists to user dicts.

The engine sends ``LogprobsLists`` (plain lists, cheap to serialise); users get, per
position, ``{token_id: Logprob(logprob, rank, decoded_token)}`` as in vLLM.
"""

from __future__ import annotations

from typing import Any, Optional

from pagedllm.messages.engine_core import EngineCoreRequest, LogprobsLists
from pagedllm.outputs import Logprob, PositionLogprobs, PromptLogprobs, SampleLogprobs


class TokenTextCache:
    """``tokenizer.decode([token_id])`` per id, memoised (shared by all requests).

    ``decoded_token`` is each token decoded alone, special tokens included (vLLM's
    convention), so a token holding part of a UTF-8 character decodes to U+FFFD.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) or ""
            self._texts[token_id] = text
        return text


def make_position_logprobs(
    token_ids: list[int],
    logprobs: list[float],
    rank: int,
    num_logprobs: int,
    decode: Optional[TokenTextCache],
) -> PositionLogprobs:
    """One position's dict: the sampled (or actual) token plus the top ``num_logprobs``.

    Args:
        token_ids: ``[sampled, top1, top2, ...]``; columns past ``num_logprobs + 1``
            are ignored.
        logprobs: natural-log probabilities of ``token_ids``, same length.
        rank: 1-based vocabulary rank of the sampled token.
        num_logprobs: how many top tokens the request asked for (0: only the sampled).
        decode: token id -> text, or None for ``decoded_token=None``.

    The top tokens get ranks 1..k. If the sampled token is also among them, it appears
    once (the dict keeps the top-k entry, which has the same logprob).
    """
    width = num_logprobs + 1
    ranks = [rank, *range(1, width)]
    return {
        token_id: Logprob(logprob, rank_, decode(token_id) if decode is not None else None)
        for token_id, logprob, rank_ in zip(token_ids[:width], logprobs[:width], ranks)
    }


class LogprobsProcessor:
    """Accumulates one request's sample and prompt logprobs.

    Attributes:
        logprobs: per generated token, or None when ``params.logprobs`` is None.
        cumulative_logprob: sum of the sampled tokens' logprobs, or None likewise.
        prompt_logprobs: ``[None, pos1, pos2, ...]`` (the first prompt token has no
            logprob), or None when ``params.prompt_logprobs`` is None. Filled over
            several steps when the prompt is prefilled in chunks.
    """

    def __init__(self, decode: Optional[TokenTextCache], request: EngineCoreRequest) -> None:
        params = request.sampling_params
        self.decode = decode if params.detokenize else None
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.logprobs: Optional[SampleLogprobs] = None
        self.cumulative_logprob: Optional[float] = None
        if self.num_logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0
        self.prompt_logprobs: Optional[PromptLogprobs] = None
        if self.num_prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self._num_prompt_logprobs_popped = 0

    def update_sample(self, lists: Optional[LogprobsLists], num_tokens: int) -> None:
        """Add the first ``num_tokens`` positions of ``lists`` (the accepted tokens)."""
        if self.logprobs is None or lists is None or self.num_logprobs is None:
            return
        for i in range(min(num_tokens, len(lists.ranks))):
            ids, logprobs, rank = lists.token_ids[i], lists.logprobs[i], lists.ranks[i]
            self.logprobs.append(
                make_position_logprobs(ids, logprobs, rank, self.num_logprobs, self.decode)
            )
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprobs[0]

    def update_prompt(self, lists: Optional[LogprobsLists]) -> None:
        """Add the prompt positions computed in one step (chunked prefill: several)."""
        if self.prompt_logprobs is None or lists is None or self.num_prompt_logprobs is None:
            return
        for ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            self.prompt_logprobs.append(
                make_position_logprobs(ids, logprobs, rank, self.num_prompt_logprobs, self.decode)
            )

    def pop_prompt_logprobs(self) -> Optional[PromptLogprobs]:
        """Prompt logprobs not popped before (for DELTA outputs); None if none are new."""
        if self.prompt_logprobs is None:
            return None
        start = self._num_prompt_logprobs_popped
        if start >= len(self.prompt_logprobs):
            return None
        self._num_prompt_logprobs_popped = len(self.prompt_logprobs)
        return self.prompt_logprobs[start:]
