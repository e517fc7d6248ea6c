"""The arguments Mamba-2's scan and its decode step share: their checks, and dt's
discretization (transformers' ``Mamba2Mixer``: ``softplus(dt + dt_bias)``, clamped to the
config's ``time_step_limit``)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

#: The default ``dt_limit``, (0, inf): no clamp at all (not even at 0).
NO_DT_LIMIT = (0.0, math.inf)


def check_bcdz(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor],
               z: Optional[torch.Tensor], d_state: int) -> None:
    """x [rows, nheads, head_dim]; B and C [rows, ngroups, d_state], nheads a multiple of
    ngroups; D [nheads] or [nheads, head_dim] or None; z x's shape or None.

    Raises:
        ValueError: naming the first argument of another shape.
    """
    rows, nheads, head_dim = x.shape
    if B.dim() != 3 or B.shape[0] != rows or B.shape[2] != d_state or nheads % B.shape[1] != 0:
        raise ValueError(f"B must be [{rows}, ngroups, {d_state}] with {nheads} a multiple of ngroups, "
                         f"got {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    if D is not None and tuple(D.shape) not in ((nheads,), (nheads, head_dim)):
        raise ValueError(f"D must be [{nheads}] or [{nheads}, {head_dim}], got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")


def discretize_dt(dt: torch.Tensor, dt_bias: Optional[torch.Tensor], softplus: bool,
                  limit: tuple[float, float]) -> torch.Tensor:
    """float32 ``clamp(softplus?(dt + dt_bias), *limit)`` (softplus with threshold 20, as
    ``torch.nn.functional.softplus``); ``dt_bias`` broadcasts against ``dt``; the limit
    ``NO_DT_LIMIT`` clamps nothing (vLLM's convention)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    if tuple(limit) != NO_DT_LIMIT:
        dt = dt.clamp(*limit)
    return dt


def dt_clamp_bounds(limit: tuple[float, float]) -> tuple[float, float]:
    """(low, high) that clamp as ``discretize_dt`` does: (-inf, inf) for ``NO_DT_LIMIT``."""
    return (-math.inf, math.inf) if tuple(limit) == NO_DT_LIMIT else (float(limit[0]), float(limit[1]))


def skip_term(x: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``D * x`` in float32 for x [..., nheads, head_dim], D [nheads] or [nheads, head_dim]."""
    return x.float() * (D.float() if D.dim() == 2 else D.float()[:, None])
