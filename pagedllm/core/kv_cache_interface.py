"""What each attention layer keeps in the KV cache, and the groups of layers that share one
block table per request (vLLM's hybrid allocator, ``kv_cache_interface`` / ``kv_cache_utils``;
plain Python, no torch).

A layer's ``KVCacheSpec`` says how many bytes a block of it takes and how many blocks a
request needs: full attention keeps every block of the context; a sliding window of W
tokens needs only the blocks that hold the last W - 1 tokens before the query; chunked
local attention of C tokens (Llama 4) only those of the query's own aligned chunk.

Layers with equal specs are grouped, every group holding the same number of layers (the
smallest count among the kinds, padded where a kind's count does not divide; as vLLM)::

    layers:  0:sw 1:full 2:sw 3:sw        (3 sliding : 1 full -> group size 1)
    groups:  G0 = full (1)   G1 = sw (0)   G2 = sw (2)   G3 = sw (3)

Every group has its own block table per request, and all draw from one pool of block ids.
The runner allocates ``group_size`` cache tensors; tensor j is shared by layer j of every
group, so one block id names the same bytes in each group and a block belongs to one group
at a time. Bytes per block = ``group_size`` x one layer's page.

State layers (Mamba-2, gated delta rule) keep a fixed-size recurrent state per request
instead of K/V per token: their ``MambaSpec`` gives its tensors' shapes and dtypes. Layers of
one spec form a *state group* (``KVCacheGroups.state_groups``), whose requests each hold a
*state slot*. NOTE: the slots are a pool of their own, not blocks of the attention pool
(vLLM pads its mamba page to the attention page so one pool serves both; that would change
the attention block size of hybrid models). Each state layer owns tensors with a leading slot
dimension, ``max_num_seqs`` slots (a request holds one from admission to its end; three
times as many with prefix caching, whose saved states take slots too: ``MambaManager``), so
the sizing sets their bytes aside before it divides the rest into attention blocks::

    budget:  [ state slots x state bytes per request | attention blocks ... ]
    layers:  0:mamba 1:mamba 2:attn 3:mamba      (Bamba)
    groups:  G0 = full (2)      state group S0 = mamba2 (0, 1, 3): a slot per request
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Optional, Sequence, Union


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


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """A layer of chunked local attention (vLLM's ``ChunkedLocalAttentionSpec``; Llama 4's
    ``attention_chunk_size`` C in tokens): a query at position i sees keys i - i % C .. i,
    those of its own aligned chunk of C positions.

    Raises:
        ValueError: a chunk below 1 token.
    """

    attention_chunk_size: int

    def __post_init__(self) -> None:
        if self.attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be a positive number of tokens, got "
                             f"{self.attention_chunk_size}.")

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request holds: a step of up to ``max_num_batched_tokens`` new
        tokens and the at most C - 1 of its first query's chunk before them, one block more
        where they straddle a boundary; never more than full attention."""
        num_tokens = min(self.attention_chunk_size - 1 + max_num_batched_tokens, max_model_len)
        return min(cdiv(num_tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))

    def describe(self) -> str:
        return f"chunked local attention {self.attention_chunk_size}"


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """A multi-head latent attention layer (vLLM's ``MLAAttentionSpec``): full attention
    whose cache holds one latent per token (``num_kv_heads`` 1 of ``head_size``
    kv_lora_rank + qk_rope_head_dim), not keys and values."""

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: the latents of ``block_size`` tokens."""
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    def describe(self) -> str:
        return "latent attention (MLA)"


@dataclass(frozen=True)
class MambaSpec:
    """A state layer's recurrent state per request (vLLM's ``MambaSpec``): one tensor per
    entry of ``shapes`` (without the slot dimension), of the matching ``dtypes`` (torch dtypes,
    or anything with an ``itemsize`` in bytes). Mamba-2: conv ``(conv_dim, width - 1)`` and
    ssm ``(nheads, head_dim, d_state)``. ``mamba_type`` names the kind in logs.

    Raises:
        ValueError: no tensors, or shapes and dtypes of different lengths.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    mamba_type: str = "mamba2"

    def __post_init__(self) -> None:
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError(f"MambaSpec needs one dtype per state tensor, got shapes {self.shapes} and dtypes "
                             f"{self.dtypes}.")

    @property
    def block_size(self) -> None:
        """A state is not paged by tokens: no block size."""
        return None

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one request's state in one layer (every tensor of it)."""
        return sum(prod(shape) * dtype.itemsize for shape, dtype in zip(self.shapes, self.dtypes))

    def describe(self) -> str:
        return f"{self.mamba_type} state"


KVCacheSpec = Union[FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MLAAttentionSpec]
#: Specs whose layers see only recent keys: their groups free older blocks (the null block stands in).
LOCAL_ATTENTION_SPECS = (SlidingWindowSpec, ChunkedLocalAttentionSpec)
#: The specs of one layer with attention and a state side by side (Falcon-H1's).
LayerSpecs = tuple[KVCacheSpec, MambaSpec]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: layers (model layer indices, at most ``group_size`` of them; fewer
    in a padded group) of one spec, sharing one block table per request; or a state group
    (``MambaSpec``: any number of layers, one state slot per request)."""

    layer_indices: tuple[int, ...]
    kv_cache_spec: Union[KVCacheSpec, MambaSpec]


@dataclass(frozen=True)
class KVCacheGroups:
    """All groups of a model and the number of layers each holds (with padding).

    Attributes:
        groups: the attention groups, full-attention ones first (none in a model of state
            layers only).
        group_size: layers per attention group; also the number of cache tensors the runner
            allocates.
        state_groups: the state groups (``MambaSpec``), after the attention groups in every
            per-group sequence (block ids, block tables, forward-context metadata): state
            group s is group ``len(groups) + s`` there.
    """

    groups: tuple[KVCacheGroupSpec, ...]
    group_size: int
    state_groups: tuple[KVCacheGroupSpec, ...] = ()

    @property
    def block_size(self) -> Optional[int]:
        """Tokens per attention block (None without attention layers)."""
        return self.groups[0].kv_cache_spec.block_size if self.groups else None  # type: ignore[union-attr]

    @property
    def num_groups(self) -> int:
        """Attention and state groups together (the length of every per-group sequence)."""
        return len(self.groups) + len(self.state_groups)

    @property
    def state_bytes_per_request(self) -> int:
        """Bytes of one request's states in every state layer (0 without state layers)."""
        return sum(len(g.layer_indices) * g.kv_cache_spec.page_size_bytes for g in self.state_groups)

    def stage_state_bytes_per_request(self, start: int, end: int) -> int:
        """Bytes of one request's states in the state layers ``start <= i < end`` (those a
        pipeline stage holds; ``state_bytes_per_request`` over all layers)."""
        return sum(sum(start <= i < end for i in g.layer_indices) * g.kv_cache_spec.page_size_bytes
                   for g in self.state_groups)

    def state_group_of_layer(self) -> dict[int, int]:
        """State layer index -> its group's index in every per-group sequence."""
        first = len(self.groups)
        return {layer: first + s for s, group in enumerate(self.state_groups) for layer in group.layer_indices}

    @property
    def block_bytes(self) -> int:
        """Bytes one block id takes across the cache tensors (one layer's page per tensor; 0
        without attention layers)."""
        return self.group_size * self.groups[0].kv_cache_spec.page_size_bytes if self.groups else 0

    @property
    def has_sliding_window(self) -> bool:
        return any(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in self.groups)

    @property
    def has_local_attention(self) -> bool:
        """Whether some group frees blocks its layers no longer see (a sliding window or
        chunked local attention): the pool then keeps block 0 as the null block."""
        return any(isinstance(g.kv_cache_spec, LOCAL_ATTENTION_SPECS) for g in self.groups)

    def group_of_layer(self) -> dict[int, tuple[int, int]]:
        """Model layer index -> (its group, its position in the group: its cache tensor)."""
        return {layer: (g, j) for g, group in enumerate(self.groups) for j, layer in enumerate(group.layer_indices)}

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of ``max_model_len`` tokens needs at most, over all attention groups."""
        return sum(g.kv_cache_spec.max_num_blocks(max_model_len, max_num_batched_tokens)  # type: ignore[union-attr]
                   for g in self.groups)


def group_layers(layer_specs: Sequence[Union[KVCacheSpec, MambaSpec, LayerSpecs, None]]) -> KVCacheGroups:
    """Group the layers (``layer_specs[i]``: layer i's spec; a tuple: the specs of a layer with
    attention and a state side by side, Falcon-H1's, which joins a group of each kind, as in
    vLLM; None: a layer with no cache) by spec, vLLM's rule: the group size is the smallest
    number of layers of one attention spec (the largest, when every kind has fewer than 1.25 x
    the smallest, to pad less); a kind's layers are dealt round-robin over its ceil(n / group
    size) groups (layers i, i + k, ...: a pipeline stage's layers spread over all of them).
    State layers (``MambaSpec``) form one state group per spec, whatever their number.

    Raises:
        ValueError: no layers, mixed block sizes, or attention layers whose pages differ in size.
    """
    if not layer_specs:
        raise ValueError("A model needs at least one layer with a cache.")
    entries = [(index, spec) for index, specs in enumerate(layer_specs)
               for spec in (specs if isinstance(specs, tuple) else (specs,)) if spec is not None]
    state_layers: dict[MambaSpec, list[int]] = {}
    for index, spec in entries:
        if isinstance(spec, MambaSpec):
            state_layers.setdefault(spec, []).append(index)
    state_groups = tuple(KVCacheGroupSpec(tuple(layers), spec) for spec, layers in state_layers.items())
    attention = [(i, s) for i, s in entries if not isinstance(s, MambaSpec)]
    if not attention:
        return KVCacheGroups((), 0, state_groups)
    groups = _group_attention_layers(attention)
    return KVCacheGroups(groups.groups, groups.group_size, state_groups)


def _group_attention_layers(layers_and_specs: list[tuple[int, KVCacheSpec]]) -> KVCacheGroups:
    """``group_layers`` of the attention layers ((model layer index, spec) pairs)."""
    layer_specs = [spec for _, spec in layers_and_specs]
    if len({s.page_size_bytes for s in layer_specs}) > 1 or len({s.block_size for s in layer_specs}) > 1:
        raise ValueError("Attention layers whose KV-cache blocks differ in size cannot share one block pool.")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for index, spec in layers_and_specs:
        by_spec.setdefault(spec, []).append(index)
    counts = [len(layers) for layers in by_spec.values()]
    group_size = min(counts)
    if max(counts) < group_size * 1.25:
        group_size = max(counts)
    kinds = sorted(by_spec.items(), key=lambda item: isinstance(item[0], LOCAL_ATTENTION_SPECS))
    groups = []
    for spec, layers in kinds:
        num_groups = cdiv(len(layers), group_size)
        groups.extend(KVCacheGroupSpec(tuple(layers[i::num_groups]), spec) for i in range(num_groups))
    return KVCacheGroups(tuple(groups), group_size)


def layer_kv_cache_specs(
    layer_windows: Sequence[Optional[int]], block_size: int, num_kv_heads: int, head_size: int, dtype_bytes: int,
    use_mla: bool = False, state_specs: Optional[dict[int, MambaSpec]] = None, cacheless: Sequence[int] = (),
    hybrid: Sequence[int] = (), attention_chunk_sizes: Optional[Sequence[Optional[int]]] = None,
) -> list[Union[KVCacheSpec, MambaSpec, LayerSpecs, None]]:
    """Each layer's spec from its attention window (None: full attention; with ``use_mla``
    latent attention, ``MLAAttentionSpec``) or its ``attention_chunk_sizes`` entry (not None:
    ``ChunkedLocalAttentionSpec``), ``state_specs[i]`` for a state layer i, (its attention's
    spec, ``state_specs[i]``) for a layer of ``hybrid`` (both side by side), or None for a
    layer of ``cacheless`` (no attention, no state)."""
    full = MLAAttentionSpec if use_mla else FullAttentionSpec
    state_specs = state_specs or {}
    chunks = list(attention_chunk_sizes or [None] * len(layer_windows))

    def attention(window: Optional[int], chunk: Optional[int]) -> KVCacheSpec:
        if chunk is not None:
            return ChunkedLocalAttentionSpec(block_size, num_kv_heads, head_size, dtype_bytes, chunk)
        if window is None:
            return full(block_size, num_kv_heads, head_size, dtype_bytes)
        return SlidingWindowSpec(block_size, num_kv_heads, head_size, dtype_bytes, window)

    return [
        None if i in cacheless
        else (attention(window, chunks[i]), state_specs[i]) if i in hybrid
        else state_specs[i] if i in state_specs
        else attention(window, chunks[i])
        for i, window in enumerate(layer_windows)
    ]
