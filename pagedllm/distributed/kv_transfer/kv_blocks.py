"""One KV-cache block as bytes: every cache tensor's page of it, end to end (torch).

A block id names one page in each of the worker's cache tensors (``bind_kv_caches``: one
tensor per layer position, in the backend's layout, whose block dimension the backend's
``get_kv_cache_shape`` tells). ``KVBlockLayout.gather`` copies whole blocks out as rows of
bytes and ``scatter`` writes such rows back, so a block can be kept elsewhere (the second KV
tier) or sent (a KV connector) without knowing the layout::

    row of block b:  | tensor 0's page b | tensor 1's page b | ... |   (uint8)
"""

from __future__ import annotations

import torch


def block_dim(kv_cache_shape) -> int:
    """The block dimension of a backend's layout: the one dimension where
    ``kv_cache_shape(num_blocks, ...)`` differs between 1 and 2 blocks.

    Args:
        kv_cache_shape: ``num_blocks -> shape`` (the backend's ``get_kv_cache_shape`` with
            the layer's other arguments bound).

    Raises:
        ValueError: a layout with no single such dimension.
    """
    one, two = kv_cache_shape(1), kv_cache_shape(2)
    dims = [d for d, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    if len(dims) != 1 or two[dims[0]] != 2:
        raise ValueError(f"A KV-cache layout without one block dimension: {one} for 1 block, {two} for 2.")
    return dims[0]


class KVBlockLayout:
    """The pages of one block in a worker's cache tensors, as one row of bytes.

    Args:
        kv_caches: the cache tensors (same number of blocks in each).
        block_dims: each tensor's block dimension (``block_dim``).
    """

    def __init__(self, kv_caches: list[torch.Tensor], block_dims: list[int]) -> None:
        if len(kv_caches) != len(block_dims):
            raise ValueError(f"{len(kv_caches)} cache tensors, {len(block_dims)} block dimensions.")
        # NOTE: copies go through byte views of the caches (any dtype, FP8 included).
        self.byte_caches = [cache.view(torch.uint8) for cache in kv_caches]
        self.block_dims = block_dims
        self.page_shapes = [cache.select(dim, 0).shape for cache, dim in zip(self.byte_caches, block_dims)]
        self.page_bytes = [cache.select(dim, 0).numel() for cache, dim in zip(self.byte_caches, block_dims)]
        #: Bytes of one block, all tensors together.
        self.block_bytes = sum(self.page_bytes)
        self.device = kv_caches[0].device if kv_caches else torch.device("cpu")

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks ``block_ids``: [len(block_ids), block_bytes] uint8, on the
        caches' device."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = [cache.index_select(dim, index).movedim(dim, 0).reshape(len(block_ids), -1)
                for cache, dim in zip(self.byte_caches, self.block_dims)]
        return torch.cat(rows, dim=1)

    def scatter(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """Write ``rows`` ([len(block_ids), block_bytes] uint8, any device) into the blocks
        ``block_ids`` of every tensor.

        Raises:
            ValueError: rows of another shape.
        """
        if tuple(rows.shape) != (len(block_ids), self.block_bytes) or rows.dtype != torch.uint8:
            raise ValueError(f"Expected [{len(block_ids)}, {self.block_bytes}] uint8 rows, got "
                             f"{list(rows.shape)} {rows.dtype}.")
        rows = rows.to(self.device)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        start = 0
        for cache, dim, shape, nbytes in zip(self.byte_caches, self.block_dims, self.page_shapes, self.page_bytes):
            pages = rows[:, start : start + nbytes].reshape(len(block_ids), *shape)
            cache.index_copy_(dim, index, pages.movedim(0, dim))
            start += nbytes
