"""Mamba-2's one-token recurrence in decode, ``selective_state_update`` (vLLM's name and
argument order; transformers' ``Mamba2Mixer.torch_forward`` with a cache, one token).

For each request ``b`` (slot ``s = state_batch_indices[b]``) and head ``h`` of group
``g = h // (nheads / ngroups)``, with ``dt' = clamp(softplus?(dt + dt_bias), dt_limit)``::

    state[s, h] = exp(dt' * A[h]) * state[s, h] + dt' * outer(x[b, h], B[b, g])   # [head_dim, d_state]
    out[b, h]   = state[s, h] @ C[b, g] + D[h] * x[b, h]     (times silu(z[b, h]) when z is given)

The state is read and written in its own dtype (float32 in the state cache), everything else
computed in float32; ``out`` is rounded once to ``x``'s dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.mamba.ops import cpu_dispatch
from pagedllm.model_executor.layers.mamba.ops.slots import kernel_slot_indices, slot_indices
from pagedllm.model_executor.layers.mamba.ops.ssm_args import (
    NO_DT_LIMIT,
    check_bcdz,
    discretize_dt,
    dt_clamp_bounds,
    skip_term,
)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    state_batch_indices: Optional[torch.Tensor] = None,
    dt_limit: tuple[float, float] = NO_DT_LIMIT,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One Mamba-2 decode step per request, the state updated in place (see the module).

    Args:
        state: [num_slots, nheads, head_dim, d_state], the state cache.
        x: [batch, nheads, head_dim].
        dt: [batch, nheads] (or vLLM's [batch, nheads, head_dim], equal along head_dim).
        A: [nheads] (or [nheads, head_dim, d_state]), negative.
        B, C: [batch, ngroups, d_state], nheads a multiple of ngroups.
        D: [nheads] or [nheads, head_dim], or None; z: [batch, nheads, head_dim] or None.
        dt_bias: [nheads] (or [nheads, head_dim]) or None; dt_softplus: apply softplus
            after the bias (threshold 20, as ``torch.nn.functional.softplus``).
        state_batch_indices: int [batch], each request's slot; None: slot ``b`` for request ``b``.
        dt_limit: (low, high) clamp of dt after softplus; (0, inf) clamps nothing.
        out: [batch, nheads, head_dim] to write into, or None.

    Returns:
        ``out`` (a new tensor of ``x``'s dtype when None). On CPU the C++ kernel runs where
        ``cpu_dispatch.use_kernels()`` (per-head dt, A, D and dt_bias, a float32 state, x, dt,
        B, C and z of one dtype), else ``selective_state_update_native``.

    Raises:
        ValueError: on inconsistent shapes.
    """
    _check(state, x, dt, A, B, C, D, z, dt_bias)
    if cpu_dispatch.use_kernels() and _kernel_form(state, x, dt, A, B, C, D, z, dt_bias):
        idx = kernel_slot_indices(state_batch_indices, x.shape[0])
        result = cpu_kernels.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx,
                                                    *dt_clamp_bounds(dt_limit))
    else:
        idx = slot_indices(state_batch_indices, x.shape[0], x.device)
        result = selective_state_update_native(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx, dt_limit)
    if out is None:
        return result
    out.copy_(result)
    return out


def _kernel_form(state, x, dt, A, B, C, D, z, dt_bias) -> bool:
    """Whether the C++ kernel takes these tensors: per-head forms of dt, A, D and dt_bias, a
    float32 state, one dtype for x, dt, B, C and z, and the kernel's contiguity."""
    return (
        state.dtype == torch.float32
        and dt.dim() == 2
        and A.dim() == 1
        and (D is None or D.dim() == 1)
        and (dt_bias is None or dt_bias.dim() == 1)
        and x.dtype == dt.dtype == B.dtype == C.dtype
        and (z is None or (z.dtype == x.dtype and z.stride(2) == 1))
        and state.stride(3) == 1
        and x.stride(2) == 1
        and B.stride(2) == 1
        and C.stride(2) == 1
    )


def _check(state, x, dt, A, B, C, D, z, dt_bias) -> None:
    if state.dim() != 4:
        raise ValueError(f"state must be [num_slots, nheads, head_dim, d_state], got {tuple(state.shape)}")
    _, nheads, head_dim, d_state = state.shape
    batch = x.shape[0]
    if tuple(x.shape) != (batch, nheads, head_dim):
        raise ValueError(f"x must be [batch, {nheads}, {head_dim}], got {tuple(x.shape)}")
    if tuple(dt.shape) not in ((batch, nheads), (batch, nheads, head_dim)):
        raise ValueError(f"dt must be [{batch}, {nheads}], got {tuple(dt.shape)}")
    if tuple(A.shape) not in ((nheads,), (nheads, head_dim, d_state)):
        raise ValueError(f"A must be [{nheads}], got {tuple(A.shape)}")
    check_bcdz(x, B, C, D, z, d_state)
    if dt_bias is not None and tuple(dt_bias.shape) not in ((nheads,), (nheads, head_dim)):
        raise ValueError(f"dt_bias must be [{nheads}], got {tuple(dt_bias.shape)}")


def selective_state_update_native(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool,
                                  state_batch_indices: torch.Tensor,
                                  dt_limit: tuple[float, float] = NO_DT_LIMIT) -> torch.Tensor:
    """``selective_state_update`` in PyTorch (every device; the C++ kernel's reference), arguments checked by the
    caller, ``state_batch_indices`` int64; returns a new [batch, nheads, head_dim] tensor."""
    nheads = state.shape[1]
    per_head = dt_bias if dt_bias is None or dt_bias.dim() == 2 else dt_bias[:, None]
    # [batch, nheads, 1 | head_dim]
    dt = discretize_dt(dt if dt.dim() == 3 else dt[:, :, None], per_head, dt_softplus, dt_limit)
    a = A.float() if A.dim() == 3 else A.float()[:, None, None]  # [nheads, 1 | head_dim, 1 | d_state]
    heads_per_group = nheads // B.shape[1]
    b = B.float().repeat_interleave(heads_per_group, dim=1)  # [batch, nheads, d_state]
    c = C.float().repeat_interleave(heads_per_group, dim=1)
    xf = x.float()
    s = state[state_batch_indices].float()  # [batch, nheads, head_dim, d_state]
    s = s * torch.exp(dt[..., None] * a) + (dt * xf)[..., None] * b[:, :, None, :]
    state[state_batch_indices] = s.to(state.dtype)
    y = torch.einsum("bhpn,bhn->bhp", s, c)
    if D is not None:
        y = y + skip_term(x, D)
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)
