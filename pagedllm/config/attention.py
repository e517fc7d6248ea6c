"""``AttentionConfig``: the attention backend chosen by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AttentionConfig:
    """The attention backend by name (``--attention-backend``); None: ``$PAGEDLLM_ATTENTION_BACKEND``,
    else chosen by platform (``pagedllm.attention.selector``, which checks the name at start-up)."""

    backend: Optional[str] = None
