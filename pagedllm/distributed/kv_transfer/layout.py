"""``KVLayout``: what a worker's KV cache looks like to another engine (a connector's handshake).

A producer and a consumer exchange their layouts at their first connection; KV moves
between them only when every field of ``MUST_MATCH`` is equal. ``block_size`` is told but
may differ: a transfer copies tokens, not blocks (``block_copy``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: The start of every layout-mismatch message (``mismatch_message``): a failure that sending
#: the request again cannot fix (``TCPConnectorScheduler.request_failed``).
LAYOUT_MISMATCH = "KV layout mismatch"


@dataclass(frozen=True)
class KVLayout:
    """One worker's KV-cache layout (plain JSON values).

    ``model``: the architecture; ``num_layers``: the worker's KV-cache tensors (its pipeline
    stage's attention layers); ``num_kv_heads`` / ``head_size``: per token of one layer on
    this rank (``num_kv_heads`` 0: MLA's one latent vector); ``kv_cache_dtype``: the cache
    tensors' element type (``--dtype`` / ``--kv-cache-dtype``).
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_cache_dtype: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    block_size: int

    #: The fields two engines must share to move KV (all but ``block_size``).
    MUST_MATCH = ("model", "num_layers", "num_kv_heads", "head_size", "kv_cache_dtype", "tensor_parallel_size",
                  "pipeline_parallel_size")

    @classmethod
    def of(cls, kv_caches: list["torch.Tensor"], block_size: int, model: str, tensor_parallel_size: int,
           pipeline_parallel_size: int) -> "KVLayout":
        """The layout of ``kv_caches`` (``block_copy``'s two cache layouts: ``[2, blocks,
        block_size, heads, head_size]`` or MLA's ``[blocks, block_size, head_size]``).

        Raises:
            ValueError: no cache tensor.
        """
        if not kv_caches:
            raise ValueError("A KV layout needs at least one KV-cache tensor.")
        cache = kv_caches[0]
        num_kv_heads, head_size = (cache.shape[3], cache.shape[4]) if cache.dim() == 5 else (0, cache.shape[-1])
        return cls(model=model, num_layers=len(kv_caches), num_kv_heads=int(num_kv_heads), head_size=int(head_size),
                   kv_cache_dtype=str(cache.dtype).removeprefix("torch."), tensor_parallel_size=tensor_parallel_size,
                   pipeline_parallel_size=pipeline_parallel_size, block_size=block_size)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "KVLayout":
        """A peer's layout (``to_json``).

        Raises:
            ValueError: not a layout (bad JSON, missing or unknown fields).
        """
        try:
            values: Any = json.loads(data)
            return cls(**{f.name: values[f.name] for f in fields(cls)})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a KV layout descriptor ({exc}): {data[:200]!r}") from None

    def mismatches(self, other: "KVLayout") -> list[tuple[str, Any, Any]]:
        """``(field, self's value, other's value)`` for each ``MUST_MATCH`` field that differs."""
        return [(name, getattr(self, name), getattr(other, name)) for name in self.MUST_MATCH
                if getattr(self, name) != getattr(other, name)]


def mismatch_message(mismatches: list[tuple[str, Any, Any]], here: str, there: str) -> str:
    """A ``LAYOUT_MISMATCH`` message naming each field with its value on both sides, e.g.
    ``"KV layout mismatch: tensor_parallel_size is 1 on this decode instance, 2 on the
    prefill instance at tcp://h:p; ..."`` (``here`` / ``there``: the two sides, described)."""
    parts = "; ".join(f"{name} is {mine} on {here}, {theirs} on {there}" for name, mine, theirs in mismatches)
    return (f"{LAYOUT_MISMATCH}: {parts}. KV cannot move between them: start both with the same model, dtype, "
            "--kv-cache-dtype and parallel sizes.")
