"""The plain-data form of a multimodal item as it crosses from the front end to the engine
(msgspec Structs, no torch: the engine core and the scheduler only read positions and hashes).

``MultiModalFeatureSpec`` is one item (an image): its modality, its content hash
(``identifier``, vLLM's ``mm_hash``), the run of placeholder tokens it fills in the prompt
(``PlaceholderRange``, vLLM's ``mm_position``, with its ``is_embed`` flags when the run holds
tokens that keep their own embedding) and the processor's tensors of that item alone
(``TensorData``, name -> array; ``pixel_values`` [1, 3, H, W] for Llava and Gemma 3, plus
``image_sizes`` [1, 2] for Mistral 3), which the model runner turns back into tensors for the
vision encoder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import msgspec

if TYPE_CHECKING:
    import torch


class PlaceholderRange(msgspec.Struct, array_like=True, frozen=True):  # type: ignore[call-arg]
    """Prompt positions ``offset`` .. ``offset + length - 1``: the item's placeholder tokens
    (vLLM's ``PlaceholderRange``). Each is replaced by the item's next embedding, or, with
    ``is_embed`` (one flag per position), only the positions flagged True are, in order, and
    the others keep their token's embedding (Pixtral's [IMG_BREAK] / [IMG_END] inside an
    image's run): the item has ``num_embeds`` embeddings.

    ::

        tokens    [IMG] [IMG] [IMG_BREAK] [IMG] [IMG] [IMG_END]
        is_embed    T     T       F         T     T       F       -> embeddings 0 1 . 2 3 .
    """

    offset: int
    length: int
    is_embed: Optional[tuple[bool, ...]] = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """The item's embeddings: ``length``, or the positions ``is_embed`` flags."""
        return self.length if self.is_embed is None else sum(self.is_embed)

    def embeds_in(self, start: int, end: int) -> tuple[list[int], int, int]:
        """The placeholder positions among prompt positions ``start`` .. ``end - 1`` that take
        an embedding, and the embeddings they take: (those positions, first embedding index,
        one past the last), so ``embeddings[first:last]`` go to the positions in order."""
        lo, hi = max(start, self.offset), min(end, self.end)
        if lo >= hi:
            return [], 0, 0
        if self.is_embed is None:
            return list(range(lo, hi)), lo - self.offset, hi - self.offset
        first = sum(self.is_embed[: lo - self.offset])
        positions = [p for p in range(lo, hi) if self.is_embed[p - self.offset]]
        return positions, first, first + len(positions)


class TensorData(msgspec.Struct, array_like=True, frozen=True):  # type: ignore[call-arg]
    """One tensor as bytes: ``dtype`` (torch's name, e.g. "float32"), ``shape`` and the
    row-major ``data``."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_tensor(cls, tensor: "torch.Tensor") -> "TensorData":
        tensor = tensor.detach().cpu().contiguous()
        return cls(str(tensor.dtype).removeprefix("torch."), list(tensor.shape), tensor.numpy().tobytes())

    def to_tensor(self) -> "torch.Tensor":
        """A tensor of ``shape`` / ``dtype`` over a copy of ``data`` (on CPU)."""
        import torch

        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).reshape(self.shape)


class MultiModalFeatureSpec(msgspec.Struct, array_like=True, frozen=True):  # type: ignore[call-arg]
    """One multimodal item of a request (vLLM's ``MultiModalFeatureSpec``): ``modality``
    ("image" or "video"), ``identifier`` (its content hash, hex: the encoder cache's key and a block-hash
    extra key), ``mm_position`` (its placeholder tokens in the prompt) and ``data`` (the
    processor's tensors of this item, by the name the model's encoder takes them)."""

    modality: str
    identifier: str
    mm_position: PlaceholderRange
    data: Optional[dict[str, TensorData]] = None
