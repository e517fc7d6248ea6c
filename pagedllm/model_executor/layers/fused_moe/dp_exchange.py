"""Experts spread over data-parallel engines (``-dp N --enable-expert-parallel``, vLLM's
attention data parallelism): the token exchange of one ``FusedMoE`` layer.

Each engine runs attention on its own requests' tokens and holds ``expert_range(E, N, r)``
of every MoE layer's experts. In each MoE layer every engine, in the same order::

    counts   all-gather [T_r]                        -> T_0 .. T_{N-1}, M = max
    tokens   all-gather x, topk_ids, topk_weights    (each padded to M rows)
    compute  this engine's experts on all sum(T) tokens (the layer's method, ``compute``)
    return   all-reduce the [N x M, H] partial sums  -> engine r keeps rows r*M .. r*M + T_r

so every engine enters the same collectives whatever its token count, zero included (an
engine with no requests runs ``layer.run_idle_exchanges``, which passes zero tokens through
every MoE layer: ``pagedllm.engine.dp_lockstep`` keeps the engines' steps in lockstep).
The sum over the engines' experts is added in the tokens' dtype by the all-reduce (as
tensor-parallel expert parallelism adds its ranks' outputs).
"""

from __future__ import annotations

from typing import Callable

import torch

from pagedllm.distributed.parallel_state import GroupCoordinator

#: ``(x [n, H], topk_weights [n, k], topk_ids [n, k]) -> [n, H]``: this engine's experts' weighted sum.
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def exchange_experts(group: GroupCoordinator, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     compute: ExpertCompute) -> torch.Tensor:
    """This engine's tokens x [T, H] (T may be 0) with their routing (``topk_weights`` [T, k]
    float32, ``topk_ids`` [T, k] int64, global expert ids) -> [T, H] in x's dtype: the sum
    over every engine of the group of its experts' weighted outputs (see the module
    docstring). A collective: every engine of ``group`` must call it for the same layer."""
    counts = group.all_gather(torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device), dim=0).tolist()
    rows = max(counts)
    if rows == 0:
        return x.new_zeros(x.shape)
    all_x = group.all_gather(_padded(x, rows), dim=0)
    all_ids = group.all_gather(_padded(topk_ids, rows), dim=0)
    all_weights = group.all_gather(_padded(topk_weights, rows), dim=0)
    valid = torch.cat([torch.arange(r * rows, r * rows + n, device=x.device) for r, n in enumerate(counts)])
    partial = x.new_zeros((len(counts) * rows, x.shape[1]))
    partial[valid] = compute(all_x[valid], all_weights[valid], all_ids[valid]).to(x.dtype)
    start = group.rank_in_group * rows
    return group.all_reduce(partial)[start : start + x.shape[0]]

