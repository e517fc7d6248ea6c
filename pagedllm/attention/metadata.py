"""The forward context: the step's attention metadata, set by the model runner, read by
every attention layer through ``get_forward_context()`` (so ``model.forward(input_ids,
positions)`` carries no plumbing). Its type is the selected backend's ``AttentionMetadata``
subclass (``pagedllm.attention.backends``). A model with several KV-cache groups (full
attention beside sliding windows) has one metadata per group, each layer reading its own
group's (``get_forward_context(kv_cache_group_id)``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Union

from pagedllm.attention.backends.abstract import AttentionMetadata

_forward_context: Optional[tuple[AttentionMetadata, ...]] = None


@contextlib.contextmanager
def set_forward_context(metadata: Union[AttentionMetadata, Sequence[AttentionMetadata]]) -> Iterator[None]:
    """Make ``metadata`` (one, or one per KV-cache group: ``metadata[g]`` for group g)
    visible to attention layers for one forward pass.

    Raises:
        RuntimeError: if a forward context is already set (contexts do not nest).
    """
    global _forward_context
    if _forward_context is not None:
        raise RuntimeError("set_forward_context does not nest; a forward pass is already running.")
    _forward_context = tuple(metadata) if isinstance(metadata, (list, tuple)) else (metadata,)
    try:
        yield
    finally:
        _forward_context = None


def get_forward_context(kv_cache_group_id: int = 0) -> AttentionMetadata:
    """The metadata of the forward pass in progress, of KV-cache group ``kv_cache_group_id``.

    Raises:
        RuntimeError: outside ``set_forward_context``.
    """
    if _forward_context is None:
        raise RuntimeError("No forward context: call the model inside set_forward_context().")
    return _forward_context[kv_cache_group_id]
