"""The pooler: a prompt's final hidden states -> one vector (vLLM's ``Pooler`` for embeddings).

A prompt may be computed over several steps (chunked prefill), so pooling is a running
state per request, fed each step's chunk in order and read once the prompt is done:

    LAST  the last prompt token's hidden state (decoder embedders)
    MEAN  the mean over every prompt token (float32 sum / count)
    CLS   the first prompt token's (BERT-style encoders)

The vector is returned raw (float32, [hidden]), or, for a classifier, through the model's
``pooler_head`` (float32 logits [num_labels]; vLLM's ``ClassifierPooler`` without its
activation); the request's ``PoolingParams`` (``dimensions``, ``normalize``, the
activation) are applied by the front end (``pagedllm.pooling_params``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagedllm.config.pooler import POOLING_TYPES


@dataclass
class PoolingState:
    """One request's pooling so far: ``value`` [hidden] float32 (the sum for MEAN, the
    chosen token's state otherwise; None before the first chunk) over ``num_tokens`` tokens."""

    value: Optional[torch.Tensor] = None
    num_tokens: int = 0


class Pooler:
    """Pools chunks of one request's final hidden states by ``pooling_type`` (``POOLING_TYPES``);
    ``head``: maps pooled states [n, hidden] to float32 [n, num_labels] (a classifier's
    ``pooler_head``; None: the pooled state is the output).

    Raises:
        ValueError: an unknown ``pooling_type``.
    """

    def __init__(self, pooling_type: str,
                 head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}.")
        self.pooling_type = pooling_type
        self.head = head

    def update(self, state: Optional[PoolingState], chunk: torch.Tensor) -> PoolingState:
        """``state`` (None: a new request) after the next ``chunk`` [n, hidden] (n >= 1) of
        the request's prompt positions, in order."""
        state = state or PoolingState()
        if self.pooling_type == "MEAN":
            total = chunk.float().sum(dim=0)
            state.value = total if state.value is None else state.value + total
        elif self.pooling_type == "LAST":
            state.value = chunk[-1].float()
        elif state.value is None:  # CLS
            state.value = chunk[0].float()
        state.num_tokens += chunk.shape[0]
        return state

    def finish(self, state: PoolingState) -> torch.Tensor:
        """The pooled vector [hidden] float32 of a prompt whose chunks all went to ``update``
        (through ``head``: [num_labels])."""
        assert state.value is not None, "finish() before any update()"
        pooled = state.value / state.num_tokens if self.pooling_type == "MEAN" else state.value
        if self.head is None:
            return pooled
        with torch.inference_mode():
            return self.head(pooled[None])[0]
