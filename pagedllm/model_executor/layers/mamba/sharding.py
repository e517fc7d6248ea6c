"""How a state layer's heads split over tensor-parallel ranks (vLLM's head sharding of
``MambaMixer2`` and the Gated DeltaNet layers).

Each rank holds ``num_heads / tp_size`` consecutive heads with everything per head: their
channels of the input projections, of the depthwise conv (weight and bias), of A, D, dt_bias
and the gated norm, their state in the state cache, and their columns of the output projection
(row-parallel, summed over the ranks). Mamba-2's B / C groups go with the heads they serve:
with ``n_groups`` a multiple of ``tp_size`` each rank holds ``n_groups / tp_size`` of them;
with ``tp_size`` a multiple of ``n_groups`` (one group, say) the ``tp_size / n_groups`` ranks
of a group each hold a copy of it.

A parameter made of consecutive checkpoint segments along its first dimension ([x | B | C] of
a conv weight, say) loads through ``segmented_weight_loader``: each segment is cut into equal
parts, and this rank's part of each lands in its slice of the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from pagedllm.distributed import divide
from pagedllm.model_executor.utils import load_weight_part


@dataclass(frozen=True)
class GroupShards:
    """The groups of ``n_groups`` (B / C groups, key heads) this rank holds at ``tp_size``.

    Attributes:
        per_rank: groups on each rank.
        part, num_parts: this rank's part of the checkpoint's groups, cut in ``num_parts``
            equal parts (``tp_size`` of them, or ``n_groups`` when groups are copied).
        ranks_per_group: ranks holding a copy of each group (1 when they are split).
    """

    per_rank: int
    part: int
    num_parts: int
    ranks_per_group: int

    @classmethod
    def of(cls, n_groups: int, tp_size: int, tp_rank: int, what: str = "n_groups") -> "GroupShards":
        """Raises ValueError unless ``n_groups`` and ``tp_size`` divide one another."""
        if n_groups % tp_size == 0:
            return cls(n_groups // tp_size, tp_rank, tp_size, 1)
        if tp_size % n_groups == 0:
            ranks = tp_size // n_groups
            return cls(1, tp_rank // ranks, n_groups, ranks)
        raise ValueError(f"{what} {n_groups} and tensor_parallel_size {tp_size} must divide one another.")


def segmented_weight_loader(segments: Sequence[tuple[int, int, int]]) -> Callable[[nn.Parameter, torch.Tensor], None]:
    """A ``weight_loader`` for a parameter whose first dimension is, per rank, the segments
    ``(rows on this rank, part, num_parts)`` in order: the checkpoint tensor holds each segment
    whole (``rows x num_parts``), and part ``part`` of each is copied.

    Raises (from the loader):
        ValueError: a checkpoint tensor of another shape.
    """
    local = [rows for rows, _, _ in segments]
    full = [rows * parts for rows, _, parts in segments]

    def load(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.shape[0] != sum(full) or param.shape[0] != sum(local):
            raise ValueError(f"Checkpoint tensor shape {tuple(loaded_weight.shape)}: dimension 0 should be "
                             f"{' + '.join(map(str, full))} (this rank holds {' + '.join(map(str, local))}).")
        offset = 0
        for (rows, part, parts), piece in zip(segments, loaded_weight.split(full, dim=0)):
            load_weight_part(param.data.narrow(0, offset, rows), piece, 0, part, parts)
            offset += rows

    return load


def head_weight_loader(num_heads: int, tp_size: int, tp_rank: int, rows_per_head: int = 1
                       ) -> Callable[[nn.Parameter, torch.Tensor], None]:
    """The loader of a per-head parameter (A_log, D, dt_bias; a norm over the heads' channels,
    ``rows_per_head`` of them): this rank's ``num_heads / tp_size`` heads."""
    return segmented_weight_loader([(divide(num_heads, tp_size) * rows_per_head, tp_rank, tp_size)])
