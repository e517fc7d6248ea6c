"""Mamba-2's state-space scan over prefill chunks, chunked (SSD, "state space duality":
Dao & Gu 2024, arXiv:2405.21060), over a varlen batch of requests, ``mamba_chunk_scan_combined``.

The recurrence it computes, per request and head ``h`` (group ``g = h // (nheads / ngroups)``),
token by token, from the request's initial state (or zeros)::

    dt'_t  = clamp(softplus?(dt_t + dt_bias), dt_limit)
    S_t    = exp(dt'_t * A[h]) * S_{t-1} + dt'_t * outer(x_t, B_t[g])      # [head_dim, d_state]
    y_t    = S_t @ C_t[g] + D[h] * x_t                  (times silu(z_t) when z is given)

Each request's tokens are cut into chunks of ``chunk_size`` (a chunk never spans two
requests; the last one of a request may be shorter and is padded with ``dt = 0``, which
leaves the state as it is). Within a chunk the outputs are one masked quadratic form (the
decays ``exp(sum_{s<u<=t} a_u)`` built by a cumulative sum per pair of positions, as
transformers' ``segment_sum``, so no large differences of cumulative sums lose precision);
between chunks the states are passed on by a scan over each request's chunks. The maths of
transformers' ``Mamba2Mixer.torch_forward`` and vLLM's ``mamba_chunk_scan_combined``; all of
it in float32 whatever the inputs' dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.mamba.ops.slots import slot_indices
from pagedllm.model_executor.layers.mamba.ops.ssm_args import NO_DT_LIMIT, check_bcdz, discretize_dt, skip_term

#: Bytes one [chunks, nheads, chunk_size, chunk_size] float32 intermediate may take: the
#: quadratic part runs over as many chunks at a time as fit.
_QUADRATIC_BYTES = 32 << 20


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    *,
    query_start_loc: torch.Tensor,
    ssm_state: torch.Tensor,
    state_batch_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_DT_LIMIT,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Mamba-2's scan over each request's tokens (see the module), final states written back.

    Args:
        x: [num_tokens, nheads, head_dim], requests contiguous along tokens.
        dt: [num_tokens, nheads]; A: [nheads] (negative).
        B, C: [num_tokens, ngroups, d_state], nheads a multiple of ngroups.
        chunk_size: tokens per chunk (the checkpoint's ``chunk_size``), at least 1.
        D: [nheads] or [nheads, head_dim], or None; z: x's shape or None (gating is usually
            left to the mixer's gated norm); dt_bias: [nheads] or None.
        query_start_loc: int [num_reqs + 1], request ``r`` is tokens
            ``query_start_loc[r] : query_start_loc[r + 1]``.
        ssm_state: [num_slots, nheads, head_dim, d_state], the state cache: request ``r``
            starts from ``ssm_state[state_batch_indices[r]]`` when ``has_initial_state[r]``
            (else zeros), and its state after its last token is written there, in place.
        state_batch_indices: int [num_reqs], each request's slot; None: slot ``r``.
        has_initial_state: bool [num_reqs]; None: no request has one.
        dt_softplus: apply softplus after the bias (threshold 20); dt_limit: (low, high)
            clamp after it, (0, inf) clamps nothing.
        out: [num_tokens, nheads, head_dim] to write into, or None.

    Returns:
        ``out``, or a new tensor of ``x``'s dtype.

    Raises:
        ValueError: on inconsistent shapes or a chunk_size below 1.
    """
    _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_state)
    num_tokens, nheads, head_dim = x.shape
    num_reqs = query_start_loc.numel() - 1
    slots = slot_indices(state_batch_indices, num_reqs, x.device)
    plan = _ChunkPlan(query_start_loc.to(device=x.device, dtype=torch.long), num_tokens, chunk_size)

    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    xs, dts = plan.pad(x.float()), plan.pad(dt)  # [chunks, L, nheads, head_dim], [chunks, L, nheads]
    bs, cs = plan.pad(B.float()), plan.pad(C.float())  # [chunks, L, ngroups, d_state]
    a = (dts * A.float()).transpose(1, 2)  # [chunks, nheads, L]
    y, chunk_states = _within_chunks(xs, dts, a, bs, cs)

    initial = ssm_state[slots].float()
    if has_initial_state is None:
        initial.zero_()
    else:  # a fresh slot may hold anything, NaN included: not read
        initial.masked_fill_(~has_initial_state.to(device=x.device, dtype=torch.bool)[:, None, None, None], 0.0)
    cum = a.cumsum(dim=-1)  # [chunks, nheads, L]
    before, final = plan.scan(initial, chunk_states, torch.exp(cum[:, :, -1]))
    y += _from_previous_chunks(cs, before, cum)
    ssm_state[slots] = final.to(ssm_state.dtype)

    y = plan.unpad(y)
    if D is not None:
        y += skip_term(x, D)
    if z is not None:
        y *= F.silu(z.float())
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_state) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [num_tokens, nheads, head_dim], got {tuple(x.shape)}")
    num_tokens, nheads, head_dim = x.shape
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if tuple(dt.shape) != (num_tokens, nheads):
        raise ValueError(f"dt must be [{num_tokens}, {nheads}], got {tuple(dt.shape)}")
    if tuple(A.shape) != (nheads,):
        raise ValueError(f"A must be [{nheads}], got {tuple(A.shape)}")
    check_bcdz(x, B, C, D, z, B.shape[2] if B.dim() == 3 else -1)
    if dt_bias is not None and tuple(dt_bias.shape) != (nheads,):
        raise ValueError(f"dt_bias must be [{nheads}], got {tuple(dt_bias.shape)}")
    if ssm_state.dim() != 4 or tuple(ssm_state.shape[1:]) != (nheads, head_dim, B.shape[2]):
        raise ValueError(f"ssm_state must be [num_slots, {nheads}, {head_dim}, {B.shape[2]}], "
                         f"got {tuple(ssm_state.shape)}")


class _ChunkPlan:
    """Where each chunk's tokens are: chunk ``c`` of the batch is request ``req[c]``'s
    ``k``-th, tokens ``start[c] .. start[c] + length[c] - 1``; chunks in token order, each
    padded to ``chunk_size`` positions (the shorter of the asked size and the longest request)."""

    def __init__(self, starts: torch.Tensor, num_tokens: int, chunk_size: int) -> None:
        device = starts.device
        lens = starts[1:] - starts[:-1]
        if bool((lens < 0).any()) or int(starts[-1]) != num_tokens:
            raise ValueError(f"query_start_loc must be non-decreasing and end at num_tokens ({num_tokens})")
        # The same chunks with less padding when every request is shorter than a chunk.
        chunk_size = max(1, min(chunk_size, int(lens.max()) if lens.numel() else 1))
        self.chunks_per_req = (lens + chunk_size - 1) // chunk_size  # [num_reqs]
        self.first_chunk = torch.cumsum(self.chunks_per_req, 0) - self.chunks_per_req
        num_chunks = int(self.chunks_per_req.sum())
        req = torch.repeat_interleave(torch.arange(lens.numel(), device=device), self.chunks_per_req,
                                      output_size=num_chunks)
        k = torch.arange(num_chunks, device=device) - self.first_chunk[req]
        start = starts[:-1][req] + k * chunk_size
        length = (starts[1:][req] - start).clamp(max=chunk_size)
        pos = torch.arange(chunk_size, device=device)
        self.valid = pos < length[:, None]  # [chunks, L]
        # Padding positions read the zero row appended at index num_tokens.
        self.index = torch.where(self.valid, start[:, None] + pos, num_tokens)

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """[num_tokens, ...] -> [chunks, chunk_size, ...], zeros past each chunk's end."""
        return torch.cat((t, t.new_zeros((1, *t.shape[1:]))))[self.index]

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """[chunks, chunk_size, ...] -> [num_tokens, ...]."""
        return t[self.valid]

    def scan(self, initial: torch.Tensor, chunk_states: torch.Tensor,
             chunk_decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """States passed from chunk to chunk within each request: (the state before each
        chunk [chunks, nheads, head_dim, d_state], each request's final state [num_reqs, ...]).

        ``initial`` [num_reqs, ...]; ``chunk_states`` each chunk's own contribution (from a
        zero state); ``chunk_decay`` [chunks, nheads] its total decay ``exp(sum a)``."""
        state = initial.clone()
        before = torch.empty_like(chunk_states)
        for k in range(int(self.chunks_per_req.max()) if self.chunks_per_req.numel() else 0):
            reqs = torch.nonzero(self.chunks_per_req > k).squeeze(1)
            ids = self.first_chunk[reqs] + k
            before[ids] = state[reqs]
            state[reqs] = state[reqs] * chunk_decay[ids][:, :, None, None] + chunk_states[ids]
        return before, state


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: ``out[..., t, s] = sum_{s < u <= t} a[..., u]`` for s <= t,
    -inf above the diagonal; each entry a cumulative sum of its own terms."""
    length = a.shape[-1]
    ones = torch.ones(length, length, dtype=torch.bool, device=a.device)
    terms = a[..., :, None].expand(*a.shape, length).masked_fill(~ones.tril(-1), 0.0)  # terms[t, s] = a[t], t > s
    return terms.cumsum(dim=-2).masked_fill(~ones.tril(0), -math.inf)


def _within_chunks(xs: torch.Tensor, dts: torch.Tensor, a: torch.Tensor, bs: torch.Tensor,
                   cs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk on its own from a zero state: (outputs [chunks, L, nheads, head_dim], final
    states [chunks, nheads, head_dim, d_state]), a few chunks at a time (``_QUADRATIC_BYTES``)."""
    num_chunks, length, nheads, head_dim = xs.shape
    ngroups, d_state = bs.shape[2], bs.shape[3]
    per_group = nheads // ngroups
    y = torch.empty_like(xs)
    states = xs.new_empty(num_chunks, nheads, head_dim, d_state)
    step = max(1, _QUADRATIC_BYTES // (nheads * length * length * 4))
    for lo in range(0, num_chunks, step):
        hi = min(num_chunks, lo + step)
        decay = torch.exp(_segsum(a[lo:hi]))  # [c, nheads, L(t), L(s)]
        scores = torch.einsum("ctgn,csgn->cgts", cs[lo:hi], bs[lo:hi])  # C_t . B_s
        weights = decay.view(hi - lo, ngroups, per_group, length, length) * scores[:, :, None]
        weights = weights.view(hi - lo, nheads, length, length) * dts[lo:hi].transpose(1, 2)[:, :, None, :]
        y[lo:hi] = torch.einsum("chts,cshp->cthp", weights, xs[lo:hi])
        # Decay from each position to the chunk's end: the last row of ``decay``.
        to_end = (decay[:, :, -1, :] * dts[lo:hi].transpose(1, 2)).transpose(1, 2)  # [c, L, nheads]
        xw = (xs[lo:hi] * to_end[..., None]).view(hi - lo, length, ngroups, per_group, head_dim)
        states[lo:hi] = torch.einsum("csgjp,csgn->cgjpn", xw, bs[lo:hi]).reshape(hi - lo, nheads, head_dim, d_state)
    return y, states


def _from_previous_chunks(cs: torch.Tensor, before: torch.Tensor, cum: torch.Tensor) -> torch.Tensor:
    """The outputs' part from the state each chunk starts with, decayed to each position:
    [chunks, L, nheads, head_dim]."""
    num_chunks, length, ngroups, _ = cs.shape
    _, nheads, head_dim, d_state = before.shape
    per_group = nheads // ngroups
    grouped = before.view(num_chunks, ngroups, per_group, head_dim, d_state)
    y = torch.einsum("ctgn,cgjpn->ctgjp", cs, grouped).reshape(num_chunks, length, nheads, head_dim)
    return y * torch.exp(cum).transpose(1, 2)[..., None]
