"""The step's tokens grouped by expert, and the experts run over their groups (pure torch,
any device): the compute of ``FusedMoE``'s methods.

Once per step, the [T, k] top-k choices are flattened and sorted by expert (a stable argsort):
``ExpertGroups`` holds, per (token, choice) pair in that order, the token's row and its routing
weight, and how many pairs each local expert has (one host sync). ``fused_experts`` then makes
one pass per active expert over its contiguous run of rows (each expert's weights read once per
step; at batch 1 only the k chosen experts are touched) and combines the weighted outputs into
[T, hidden] with one ``index_add_``.

    topk_ids [T=3, k=2]   flattened      sorted by expert      counts
    t0: (2, 0)            2 0 1 2 0 1    0 0 | 1 1 | 2 2        [2, 2, 2, 0]
    t1: (1, 2)                           t0 t2 | t1 t2 | t0 t1
    t2: (0, 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

#: ``(local expert id, rows [n, hidden]) -> [n, hidden]``: one expert's MLP on its tokens.
ExpertForward = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertGroups:
    """(token, choice) pairs of a step sorted by local expert.

    Attributes:
        token_rows: [N] int64, the row of ``x`` of each pair (N = pairs routed to this rank's experts).
        weights: [N] float32, each pair's routing weight.
        counts: pairs per local expert (a list of ``num_local_experts`` ints): expert e's rows
            are ``token_rows[sum(counts[:e]) : sum(counts[:e + 1])]``.
    """

    token_rows: torch.Tensor
    weights: torch.Tensor
    counts: list[int]


def group_by_expert(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_local_experts: int,
    expert_map: Optional[torch.Tensor] = None,
) -> ExpertGroups:
    """Group the choices ``topk_ids`` [T, k] (global expert ids, int64) with ``topk_weights``
    [T, k] by local expert. ``expert_map`` [E] int64 maps a global id to this rank's local id,
    or -1 for an expert held elsewhere (expert parallelism: those pairs are dropped); None:
    every expert is local (global id == local id)."""
    num_choices = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    if expert_map is not None:
        ids = expert_map[ids]
        ids = torch.where(ids < 0, num_local_experts, ids)  # held elsewhere: one bin past the last
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=num_local_experts + 1)[:num_local_experts].tolist()
    kept = order[: sum(counts)]
    return ExpertGroups(kept // num_choices, topk_weights.reshape(-1).float()[kept], counts)


def fused_experts(x: torch.Tensor, groups: ExpertGroups, expert_forward: ExpertForward) -> torch.Tensor:
    """x [T, hidden] -> sum over each token's choices of weight x expert(x) [T, hidden] (x's
    dtype; summed in float32, expert by expert in id order as transformers' loop does)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if not groups.counts or sum(groups.counts) == 0:
        return out.to(x.dtype)
    rows = x.index_select(0, groups.token_rows)
    expert_out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(groups.counts):
        if count:
            expert_out[start : start + count] = expert_forward(expert, rows[start : start + count])
            start += count
    out.index_add_(0, groups.token_rows, expert_out.mul_(groups.weights[:, None]))
    return out.to(x.dtype)
