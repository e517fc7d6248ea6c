"""The forward context: the step's attention metadata, set by the model runner, read by
every attention layer through ``get_forward_context()`` (so ``model.forward(input_ids,
positions)`` carries no plumbing). Its type is the selected backend's ``AttentionMetadata``
subclass (``pagedllm.attention.backends``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from pagedllm.attention.backends.abstract import AttentionMetadata

_forward_context: Optional[AttentionMetadata] = None


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Make ``metadata`` visible to attention layers for one forward pass.

    Raises:
        RuntimeError: if a forward context is already set (contexts do not nest).
    """
    global _forward_context
    if _forward_context is not None:
        raise RuntimeError("set_forward_context does not nest; a forward pass is already running.")
    _forward_context = metadata
    try:
        yield
    finally:
        _forward_context = None


def get_forward_context() -> AttentionMetadata:
    """The metadata of the forward pass in progress.

    Raises:
        RuntimeError: outside ``set_forward_context``.
    """
    if _forward_context is None:
        raise RuntimeError("No forward context: call the model inside set_forward_context().")
    return _forward_context
