"""The attention-backend interface: what the model runner and the ``Attention`` layer may
rely on, whichever backend runs.

A backend is a class-level bundle (vLLM's shape):

- ``AttentionBackend``: name, supported block sizes and dtypes, KV-cache shape, and the
  classes below; ``validate_configuration`` says why it cannot run here, if it cannot.
- ``AttentionMetadataBuilder``: turns the step's batch (``CommonAttentionMetadata``, plain
  numpy arrays the runner has anyway) into the backend's own ``AttentionMetadata`` subclass,
  once per step. The runner knows nothing of what is inside.
- ``AttentionImpl``: one per attention layer; ``forward`` writes the step's K/V into the
  layer's paged cache through ``slot_mapping`` and attends.

Token order in a step: the ``num_decodes`` decode requests first, one query token each;
then the prefill requests (query length > 1, possibly a chunk of a longer prompt), each a
contiguous run of tokens.

Attention is causal, except inside a request's ``bidirectional_ranges`` (an image's tokens
under Gemma 3's ``token_type_ids`` mask): there a query also sees the later keys of its range.
A backend honours them only if its impl's ``supports_bidirectional_ranges`` says so.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, Optional, TypeVar

import numpy as np
import torch

from pagedllm.attention.kv_cache_quant import is_fp8

if TYPE_CHECKING:
    from torch import nn


@dataclass
class CommonAttentionMetadata:
    """The step's batch as the runner has it, on the host; input of every builder.

    Attributes:
        query_start_loc: [num_reqs + 1] int64; request r's query tokens are
            ``query_start_loc[r]:query_start_loc[r + 1]`` of the step's tokens.
        seq_lens: [num_reqs] int64; context length of each request, this step's tokens
            included.
        num_computed_tokens: [num_reqs] int64; tokens already in the cache before this step.
        block_table: [num_reqs, max_blocks] int64; each request's block ids, at least
            ``ceil(seq_len / block_size)`` columns (padding past them: any valid block id).
        slot_mapping: [num_tokens] int64; cache slot of each token's K/V
            (``block_id * block_size + offset``).
        num_decodes: the first ``num_decodes`` requests have one query token each.
        bidirectional_ranges: [num_ranges, 3] int64 rows (request index r, start, end), or
            None: request r's context positions start .. end - 1 attend to each other both
            ways, so a query at position i in the range sees keys up to end - 1 (a sliding
            window W still hides keys <= i - W, as transformers' AND of the window with the
            OR of causal and range masks). Every range overlaps the step's query tokens of its
            request and ends at or before its ``seq_len`` (its later keys are in this step: the
            scheduler never cuts a range, ``SchedulerConfig.disable_chunked_mm_input``).
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    num_computed_tokens: np.ndarray
    block_table: np.ndarray
    slot_mapping: np.ndarray
    num_decodes: int
    bidirectional_ranges: Optional[np.ndarray] = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    def tokens_as_decodes(self) -> tuple[np.ndarray, np.ndarray]:
        """Every token of the step as a decode query of its own: ([num_tokens] its request's
        index, [num_tokens] its position + 1, the context it attends causally)."""
        token_req = np.repeat(np.arange(self.num_reqs), np.diff(self.query_start_loc))
        # token t of request r (tokens [start_r, end_r)): position seq_len_r - (end_r - t).
        return token_req, (self.seq_lens - self.query_start_loc[1:] + 1)[token_req] + np.arange(self.num_tokens)

    def query_key_ends(self) -> np.ndarray:
        """[num_tokens] int64: the end (exclusive) of the keys each query token sees: its
        position + 1, or the end of the ``bidirectional_ranges`` entry holding it."""
        token_req, ends = self.tokens_as_decodes()
        if self.bidirectional_ranges is None:
            return ends
        ends = ends.copy()
        for req, start, end in self.bidirectional_ranges:
            inside = (token_req == req) & (ends > start) & (ends <= end)  # position ends - 1 in [start, end)
            ends[inside] = end
        return ends


@dataclass
class AttentionMetadata:
    """What every backend's metadata carries; backends subclass it with their own fields.

    Attributes:
        slot_mapping: [num_tokens] int64 on the device; where each token's K/V is written.
        num_decodes: decode requests (the first ``num_decodes`` tokens, one each).
        num_prefills: prefill requests (the tokens after the decodes).
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    num_prefills: int


M = TypeVar("M", bound=AttentionMetadata)


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Builds one backend's metadata from the step's batch, once per step.

    Args:
        block_size: tokens per KV-cache block.
        device: where the metadata's tensors go.
        batch_invariant: every query token is to be attended alone, so that its output does not
            depend on the other tokens of the step (``--batch-invariant``); each backend's
            metadata says how it does so.
    """

    def __init__(self, block_size: int, device: torch.device, batch_invariant: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.batch_invariant = batch_invariant

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M:
        """The metadata for the step ``common`` describes (host arrays in, device tensors out)."""

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on ``device`` (no copy on CPU)."""
        return torch.from_numpy(array).to(self.device, non_blocking=True)


class AttentionImpl(ABC, Generic[M]):
    """One attention layer's computation, for one backend.

    Args:
        num_heads: query heads; head_size: channels per head; scale: softmax scale (any:
            scores are ``scale * q.k``, e.g. Gemma's ``query_pre_attn_scalar ** -0.5``);
        num_kv_heads: key/value heads (``num_heads`` is a multiple of it);
        sliding_window: W tokens: a query at position i attends to keys i - W + 1 .. i
            only; None: to its whole context.
        logits_soft_cap: scores become ``cap * tanh(score / cap)`` before the softmax
            (Gemma 2's ``attn_logit_softcapping``, vLLM's ``logits_soft_cap``); None (or 0,
            as in vLLM): none.
        attention_chunk_size: C tokens: chunked local attention, a query at position i
            attends to keys i - i % C .. i only (its aligned chunk; Llama 4's); None: none.

    Attention sinks (gpt-oss) are the layer's: ``forward`` reads ``layer.sinks``, [num_heads]
    float32 or None (see ``forward``).

    Raises:
        ValueError: ``sliding_window``, ``logits_soft_cap`` or ``attention_chunk_size`` set
            for a backend without it (its ``supports_sliding_window`` /
            ``supports_logits_soft_cap`` / ``supports_chunked_local_attention`` is False), or
            not a positive int / number; both a window and a chunk.
    """

    #: Whether the impl honours ``sliding_window`` (``AttentionBackend.supports_sliding_window``).
    supports_sliding_window: ClassVar[bool] = False
    #: Whether the impl honours ``logits_soft_cap``.
    supports_logits_soft_cap: ClassVar[bool] = False
    #: Whether the impl honours ``layer.sinks``.
    supports_sinks: ClassVar[bool] = False
    #: Whether the impl honours ``CommonAttentionMetadata.bidirectional_ranges``.
    supports_bidirectional_ranges: ClassVar[bool] = False
    #: Whether the impl honours ``attention_chunk_size``.
    supports_chunked_local_attention: ClassVar[bool] = False

    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None, attention_chunk_size: Optional[int] = None,
    ) -> None:
        if attention_chunk_size is not None:
            if not self.supports_chunked_local_attention:
                raise ValueError(f"{type(self).__name__} has no chunked local attention "
                                 f"(attention_chunk_size={attention_chunk_size}).")
            if isinstance(attention_chunk_size, bool) or not isinstance(attention_chunk_size, int) or (
                    attention_chunk_size < 1):
                raise ValueError(f"attention_chunk_size must be a positive number of tokens, got "
                                 f"{attention_chunk_size!r}.")
            if sliding_window is not None:
                raise ValueError("A layer has either a sliding_window or an attention_chunk_size, not both.")
        if sliding_window is not None:
            if not self.supports_sliding_window:
                raise ValueError(f"{type(self).__name__} has no sliding-window attention (sliding_window={sliding_window}).")
            if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
                raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window!r}.")
        if logits_soft_cap == 0:
            logits_soft_cap = None
        if logits_soft_cap is not None:
            if not self.supports_logits_soft_cap:
                raise ValueError(f"{type(self).__name__} has no logits soft-capping (logits_soft_cap={logits_soft_cap}).")
            if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)) or not (
                0 < logits_soft_cap < float("inf")
            ):
                raise ValueError(f"logits_soft_cap must be a positive finite number, got {logits_soft_cap!r}.")
            logits_soft_cap = float(logits_soft_cap)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attention_chunk_size = attention_chunk_size

    @staticmethod
    def layer_sinks(layer: Optional[nn.Module]) -> Optional[torch.Tensor]:
        """``layer.sinks`` ([num_heads] logits) or None (also for no layer, as in tests of an
        impl alone)."""
        return getattr(layer, "sinks", None) if layer is not None else None

    @abstractmethod
    def forward(self, layer: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: M) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache`` at ``attn_metadata.slot_mapping``, then
        attend: each query sees its request's context up to and including itself, inside a
        bidirectional range up to the range's end (with ``sliding_window`` W, only keys after
        its position - W; the block-table entries of blocks
        wholly before them may name any block of the cache, whatever it holds, NaN included,
        and do not affect the output). Scores ``scale * q.k``, soft-capped with ``logits_soft_cap``; with
        ``layer.sinks`` (s_h per query head h) the softmax's denominator gains ``exp(s_h)``:
        ``out = sum_j exp(x_j) v_j / (exp(s_h) + sum_j exp(x_j))`` (transformers' gpt_oss).

        Args:
            layer: the calling ``Attention`` layer (its ``sinks``, its FP8 scales).
            query: [num_tokens, num_heads, head_size].
            key, value: [num_tokens, num_kv_heads, head_size], the query's dtype.
            kv_cache: the layer's cache, of the backend's ``get_kv_cache_shape``, in the
                query's dtype or FP8 (then scaled by ``layer.k_scale_float`` /
                ``layer.v_scale_float``; see ``pagedllm.attention.kv_cache_quant``).
            attn_metadata: built by this backend's builder for the step.

        Returns:
            [num_tokens, num_heads, head_size], the dtype of ``query``.
        """

    @staticmethod
    def kv_scales(layer: Optional[nn.Module], kv_cache: torch.Tensor) -> tuple[float, float]:
        """(k_scale, v_scale) of ``layer``'s FP8 cache; (1.0, 1.0) for a cache in the model's
        dtype (whose ``layer`` may then be None, as in tests of an impl alone)."""
        if layer is None or not is_fp8(kv_cache.dtype):
            return 1.0, 1.0
        return layer.k_scale_float, layer.v_scale_float


class AttentionBackend:
    """A way to run paged attention; registered by name in ``pagedllm.attention.selector``.

    A subclass sets ``name`` (what ``--attention-backend`` takes, upper case), ``builder_cls``
    and ``impl_cls``, and overrides the ``get_supported_*`` / ``validate_configuration``
    methods where it is narrower than the defaults.
    """

    name: ClassVar[str]
    builder_cls: ClassVar[type[AttentionMetadataBuilder]]
    impl_cls: ClassVar[type[AttentionImpl]]

    @classmethod
    def get_name(cls) -> str:
        """The backend's name, e.g. ``"TORCH_SDPA"``."""
        return cls.name

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        """The metadata builder class."""
        return cls.builder_cls

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        """The per-layer implementation class."""
        return cls.impl_cls

    @classmethod
    def is_mla(cls) -> bool:
        """Whether the backend runs multi-head latent attention (``MLAAttention`` layers, a
        latent cache) rather than ``Attention`` over keys and values (vLLM's ``is_mla``)."""
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """Whether the backend masks keys older than a layer's ``sliding_window``."""
        return cls.impl_cls.supports_sliding_window

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        """Whether the backend soft-caps scores (a layer's ``logits_soft_cap``)."""
        return cls.impl_cls.supports_logits_soft_cap

    @classmethod
    def supports_sinks(cls) -> bool:
        """Whether the backend adds a layer's attention ``sinks`` to the softmax."""
        return cls.impl_cls.supports_sinks

    @classmethod
    def supports_bidirectional_ranges(cls) -> bool:
        """Whether the backend attends both ways inside ``bidirectional_ranges``."""
        return cls.impl_cls.supports_bidirectional_ranges

    @classmethod
    def supports_chunked_local_attention(cls) -> bool:
        """Whether the backend masks keys before a query's chunk (a layer's ``attention_chunk_size``)."""
        return cls.impl_cls.supports_chunked_local_attention

    @classmethod
    def missing_features(cls, uses_sliding_window: bool = False, uses_logits_soft_cap: bool = False,
                         has_sinks: bool = False, uses_bidirectional_ranges: bool = False,
                         uses_chunked_local_attention: bool = False) -> list[str]:
        """The features asked for that the backend lacks, by name (empty: none)."""
        wanted = [
            (uses_sliding_window, cls.supports_sliding_window, "sliding-window attention"),
            (uses_logits_soft_cap, cls.supports_logits_soft_cap, "logits soft-capping"),
            (has_sinks, cls.supports_sinks, "attention sinks"),
            (uses_bidirectional_ranges, cls.supports_bidirectional_ranges, "bidirectional attention in image spans"),
            (uses_chunked_local_attention, cls.supports_chunked_local_attention, "chunked local attention"),
        ]
        return [what for used, supported, what in wanted if used and not supported()]

    @staticmethod
    def get_supported_block_sizes() -> tuple[int, ...]:
        """Block sizes this backend can page with; empty: any."""
        return ()

    @staticmethod
    def get_supported_dtypes() -> tuple[torch.dtype, ...]:
        """Query / KV-cache dtypes this backend computes in."""
        return (torch.float32, torch.bfloat16, torch.float16)

    @staticmethod
    def get_supported_kv_cache_dtypes() -> tuple[str, ...]:
        """``--kv-cache-dtype`` values this backend reads and writes ("auto": the model's dtype)."""
        return ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """One layer's KV-cache shape: ``[2, num_blocks, block_size, num_kv_heads,
        head_size]`` (0 = keys, 1 = values; see ``pagedllm.attention.paged_kv_cache``)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def validate_configuration(
        cls, head_size: int, dtype: torch.dtype, block_size: Optional[int], kv_cache_dtype: str = "auto",
        uses_sliding_window: bool = False, uses_logits_soft_cap: bool = False, has_sinks: bool = False,
        uses_bidirectional_ranges: bool = False, uses_chunked_local_attention: bool = False,
    ) -> list[str]:
        """Why this backend cannot run here with these settings (empty: it can). Subclasses
        add their own reasons (device, kernels) to these.

        Args:
            head_size: channels per head; dtype: the model's compute dtype;
            block_size: tokens per block, or None when not yet known (not checked);
            kv_cache_dtype: ``--kv-cache-dtype``;
            uses_sliding_window: some layer of the model has a ``sliding_window``;
            uses_logits_soft_cap: some layer has a ``logits_soft_cap``;
            has_sinks: some layer has attention ``sinks``;
            uses_bidirectional_ranges: the model attends both ways inside its images' tokens;
            uses_chunked_local_attention: some layer has an ``attention_chunk_size``.
        """
        missing = cls.missing_features(uses_sliding_window, uses_logits_soft_cap, has_sinks, uses_bidirectional_ranges,
                                       uses_chunked_local_attention)
        reasons = [f"it has no {', '.join(missing)}, which the model uses"] if missing else []
        if dtype not in cls.get_supported_dtypes():
            names = ", ".join(str(d).removeprefix("torch.") for d in cls.get_supported_dtypes())
            reasons.append(f"dtype {str(dtype).removeprefix('torch.')} is not supported (supported: {names})")
        sizes = cls.get_supported_block_sizes()
        if block_size is not None and sizes and block_size not in sizes:
            reasons.append(f"block size {block_size} is not supported (supported: {', '.join(map(str, sizes))})")
        if kv_cache_dtype not in cls.get_supported_kv_cache_dtypes():
            names = ", ".join(cls.get_supported_kv_cache_dtypes())
            reasons.append(f"kv_cache_dtype {kv_cache_dtype} is not supported (supported: {names})")
        return reasons
