"""What each attention layer keeps in the KV cache, and the groups of layers that share one
block table per request (vLLM's hybrid allocator, ``kv_cache_interface`` / ``kv_cache_utils``;
plain Python, no torch).

A layer's ``KVCacheSpec`` says how many bytes a block of it takes and how many blocks a
request needs: full attention keeps every block of the context; a sliding window of W
tokens needs only the blocks that hold the last W - 1 tokens before the query.

Layers with equal specs are grouped, every group holding the same number of layers (the
smallest count among the kinds, padded where a kind's count does not divide; as vLLM)::

    layers:  0:sw 1:full 2:sw 3:sw        (3 sliding : 1 full -> group size 1)
    groups:  G0 = full (1)   G1 = sw (0)   G2 = sw (2)   G3 = sw (3)

Every group has its own block table per request, and all draw from one pool of block ids.
The runner allocates ``group_size`` cache tensors; tensor j is shared by layer j of every
group, so one block id names the same bytes in each group and a block belongs to one group
at a time. Bytes per block = ``group_size`` x one layer's page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


@dataclass(frozen=True)
class AttentionSpec:
    """What every attention layer's KV cache has (vLLM's ``AttentionSpec``).

    Attributes:
        block_size: tokens per block; num_kv_heads: this rank's KV heads;
        head_size: channels per head; dtype_bytes: bytes per cache element.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: K and V of ``block_size`` tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """A layer attending over the whole context (vLLM's ``FullAttentionSpec``)."""

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request holds in this layer's group: its whole context."""
        del max_num_batched_tokens
        return cdiv(max_model_len, self.block_size)

    def describe(self) -> str:
        return "full attention"


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A layer whose query at position i sees keys i - W + 1 .. i (vLLM's
    ``SlidingWindowSpec``; ``sliding_window`` W in tokens).

    Raises:
        ValueError: a window below 1 token.
    """

    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {self.sliding_window}.")

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request holds: a chunk of up to ``max_num_batched_tokens``
        new tokens and the W - 1 before it, one block more where they straddle a boundary
        (vLLM's ``SlidingWindowSpec.max_memory_usage_bytes``); never more than full attention."""
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return min(cdiv(num_tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))

    def describe(self) -> str:
        return f"sliding window {self.sliding_window}"


KVCacheSpec = Union[FullAttentionSpec, SlidingWindowSpec]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: layers (model layer indices, at most ``group_size`` of them; fewer
    in a padded group) of one spec, sharing one block table per request."""

    layer_indices: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheGroups:
    """All groups of a model and the number of layers each holds (with padding).

    Attributes:
        groups: the groups, full-attention ones first.
        group_size: layers per group; also the number of cache tensors the runner allocates.
    """

    groups: tuple[KVCacheGroupSpec, ...]
    group_size: int

    @property
    def block_size(self) -> int:
        return self.groups[0].kv_cache_spec.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes one block id takes across the cache tensors (one layer's page per tensor)."""
        return self.group_size * self.groups[0].kv_cache_spec.page_size_bytes

    @property
    def has_sliding_window(self) -> bool:
        return any(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in self.groups)

    def group_of_layer(self) -> dict[int, tuple[int, int]]:
        """Model layer index -> (its group, its position in the group: its cache tensor)."""
        return {layer: (g, j) for g, group in enumerate(self.groups) for j, layer in enumerate(group.layer_indices)}

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of ``max_model_len`` tokens needs at most, over all groups."""
        return sum(g.kv_cache_spec.max_num_blocks(max_model_len, max_num_batched_tokens) for g in self.groups)


def group_layers(layer_specs: Sequence[KVCacheSpec]) -> KVCacheGroups:
    """Group the layers (``layer_specs[i]``: layer i's spec) by spec, vLLM's rule: the group
    size is the smallest number of layers of one spec (the largest, when every kind has
    fewer than 1.25 x the smallest, to pad less); a kind's layers are dealt round-robin
    over its ceil(n / group size) groups (layers i, i + k, ...: a pipeline stage's layers
    spread over all of them).

    Raises:
        ValueError: no layers, mixed block sizes, or layers whose pages differ in size.
    """
    if not layer_specs:
        raise ValueError("A model needs at least one attention layer for a KV cache.")
    if len({s.page_size_bytes for s in layer_specs}) > 1 or len({s.block_size for s in layer_specs}) > 1:
        raise ValueError("Attention layers whose KV-cache blocks differ in size cannot share one block pool.")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for index, spec in enumerate(layer_specs):
        by_spec.setdefault(spec, []).append(index)
    counts = [len(layers) for layers in by_spec.values()]
    group_size = min(counts)
    if max(counts) < group_size * 1.25:
        group_size = max(counts)
    kinds = sorted(by_spec.items(), key=lambda item: isinstance(item[0], SlidingWindowSpec))
    groups = []
    for spec, layers in kinds:
        num_groups = cdiv(len(layers), group_size)
        groups.extend(KVCacheGroupSpec(tuple(layers[i::num_groups]), spec) for i in range(num_groups))
    return KVCacheGroups(tuple(groups), group_size)


def layer_kv_cache_specs(
    layer_windows: Sequence[Optional[int]], block_size: int, num_kv_heads: int, head_size: int, dtype_bytes: int,
) -> list[KVCacheSpec]:
    """Each layer's spec from its attention window (None: full attention)."""
    return [
        FullAttentionSpec(block_size, num_kv_heads, head_size, dtype_bytes) if window is None
        else SlidingWindowSpec(block_size, num_kv_heads, head_size, dtype_bytes, window)
        for window in layer_windows
    ]
