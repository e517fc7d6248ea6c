"""Logprobs in the OpenAI responses: clamping, the top entries of a position, and vLLM's
``prompt_logprobs`` JSON."""

from __future__ import annotations

from typing import Optional

from pagedllm.entrypoints.openai.protocol import LogprobInfo, PromptLogprobsJSON
from pagedllm.outputs import Logprob, PositionLogprobs, PromptLogprobs

#: Logprobs are clamped to this floor so the JSON never holds -inf (as vLLM and OpenAI).
MIN_LOGPROB = -9999.0


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def top_entries(position: PositionLogprobs, num: int) -> list[tuple[int, Logprob]]:
    """The ``num`` most likely tokens of one position, most likely first."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num]
    ranked.sort(key=lambda item: item[1].rank or 0)
    return ranked


def prompt_logprobs_json(prompt_logprobs: Optional[PromptLogprobs]) -> Optional[PromptLogprobsJSON]:
    """vLLM's ``prompt_logprobs`` field: per prompt token, None or ``{id: {logprob, rank, decoded_token}}``."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            tid: LogprobInfo(logprob=clamp_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in position.items()
        }
        for position in prompt_logprobs
    ]
