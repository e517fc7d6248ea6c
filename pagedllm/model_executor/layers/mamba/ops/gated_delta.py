"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024, arXiv:2412.06464), Qwen3-Next's linear
attention, over the runner's varlen batches, in pure torch (float32 inside, whatever the inputs).

Per value head, with state S [head_k_dim, head_v_dim], token t updates and reads::

    S = exp(g_t) * S                                  (gated decay, g_t <= 0)
    S = S + k_t (beta_t * (v_t - S^T k_t))^T           (delta rule: write the correction)
    o_t = S^T (scale * q_t)

``chunk_gated_delta_rule`` computes it for prefill chunks in blocks of ``chunk_size`` tokens
(the UT transform within a block, the recurrence across blocks, as transformers'
``torch_chunk_gated_delta_rule``); ``fused_recurrent_gated_delta_rule`` one token per request
for decode, as ``torch_recurrent_gated_delta_rule``. Names and argument conventions are the
``fla`` ops' that vLLM calls (token-major ``[num_tokens, heads, dim]``; ``num_v_heads`` a
multiple of ``num_k_heads``, each q/k head serving consecutive value heads). The state cache
holds ``ssm_state`` ``[num_slots, num_v_heads, head_k_dim, head_v_dim]``.

On CPU both run the C++ kernels (``pagedllm.kernels.cpu``, ``gated_delta.cpp``: the same maths
token by token) where ``cpu_dispatch.use_kernels()`` and the tensors are in the kernels' form
(``_kernel_form``); the PyTorch code below is the portable path and the kernels' reference.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.mamba.ops import cpu_dispatch
from pagedllm.model_executor.layers.mamba.ops.slots import kernel_slot_indices

#: Tokens per block of the chunked form (transformers' and fla's default).
CHUNK_SIZE = 64
#: The epsilon of the q/k L2 norm (``use_qk_l2norm_in_kernel``), as fla and transformers.
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  ssm_state: torch.Tensor) -> None:
    """Raise ValueError unless q, k [T, H, K], v [T, HV, V], g, beta [T, HV] and ssm_state
    [slots, HV, K, V] agree, with HV a multiple of H."""
    if q.dim() != 3 or q.shape != k.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must be [num_tokens, num_k_heads, head_k_dim] and v [num_tokens, num_v_heads, "
                         f"head_v_dim], got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    num_tokens, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads {num_v_heads} is not a multiple of num_k_heads {num_k_heads}.")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (num_tokens, num_v_heads):
            raise ValueError(f"{name} must be [num_tokens, num_v_heads] = {(num_tokens, num_v_heads)}, "
                             f"got {tuple(t.shape)}.")
    if ssm_state.dim() != 4 or tuple(ssm_state.shape[1:]) != (num_v_heads, head_k_dim, head_v_dim):
        raise ValueError(f"ssm_state must be [num_slots, {num_v_heads}, {head_k_dim}, {head_v_dim}], "
                         f"got {tuple(ssm_state.shape)}.")


def _kernel_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ssm_state: torch.Tensor) -> bool:
    """Whether the C++ kernels take these tensors: q, k and v of one dtype with contiguous last
    dimensions, the state float32 or of v's dtype with its last two dimensions contiguous."""
    return (
        q.dtype == k.dtype == v.dtype
        and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
        and ssm_state.dtype in (torch.float32, v.dtype)
        and ssm_state.stride(3) == 1 and ssm_state.stride(2) == ssm_state.shape[3]
    )


def _scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 scale: Optional[float], use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """The inputs in float32, value-head-major ([HV, T, ...]; [HV, T] for g and beta), q/k
    repeated to the value heads, L2-normed if asked, and q scaled (None: head_k_dim ** -0.5)."""
    group = v.shape[1] // k.shape[1]
    q, k = (x.repeat_interleave(group, dim=1) if group > 1 else x for x in (q, k))
    q, k, v, g, beta = (x.transpose(0, 1).to(torch.float32).contiguous() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * _scale(q, scale), k, v, g, beta


def _chunk_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [H, L, K], v [H, L, V], g, beta [H, L], state [H, K, V] (float32,
    q already scaled) -> (out [H, L, V], the state after the last token)."""
    heads, length = q.shape[:2]
    pad = -length % chunk_size
    if pad:  # padded tokens: k = 0 and beta = 0 write nothing, g = 0 decays nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    blocks = (length + pad) // chunk_size
    q, k, v = (x.reshape(heads, blocks, chunk_size, -1) for x in (q, k, v))
    log_decay = g.reshape(heads, blocks, chunk_size).cumsum(-1)  # log decay from the block start to t
    beta = beta.reshape(heads, blocks, chunk_size, 1)
    # decay[..., i, j]: from token j to token i of a block (j <= i; 0 above the diagonal).
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta
    # UT transform: (I + strictly_lower(beta k k^T * decay)) u = beta v, and w for the state read.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * log_decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * log_decay.exp().unsqueeze(-1)
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp().unsqueeze(-1)
    block_decay = log_decay[..., -1].exp()[..., None, None]
    out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    for i in range(blocks):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ v_new
        state = state * block_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    return out.view(heads, -1, out.shape[-1])[:, :length], state


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    ssm_state: torch.Tensor, query_start_loc: torch.Tensor, cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor, scale: Optional[float] = None, use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The gated delta rule over prefill chunks of a varlen batch; each request starts from its
    slot's state when ``has_initial_state`` (else zeros) and its final state is written back.

    Args:
        q, k: [num_tokens, num_k_heads, head_k_dim]; v: [num_tokens, num_v_heads, head_v_dim];
            requests contiguous, ``query_start_loc`` (int32 [num_reqs + 1]) their bounds.
        g: [num_tokens, num_v_heads], the log decay (<= 0); beta: [num_tokens, num_v_heads].
        ssm_state: [num_slots, num_v_heads, head_k_dim, head_v_dim]; read and written at
            ``cache_indices`` (int [num_reqs]) in place, in its own dtype.
        has_initial_state: bool [num_reqs]; False: the request starts from a zero state.
        scale: on q (None: head_k_dim ** -0.5); use_qk_l2norm_in_kernel: L2-norm q and k first.

    Returns:
        [num_tokens, num_v_heads, head_v_dim] in v's dtype.

    Raises:
        ValueError: shapes that do not agree, or ``query_start_loc`` not ending at num_tokens.
    """
    _check_inputs(q, k, v, g, beta, ssm_state)
    bounds = query_start_loc.tolist()
    if bounds[-1] != q.shape[0] or len(cache_indices) != len(bounds) - 1 or len(has_initial_state) != len(bounds) - 1:
        raise ValueError(f"query_start_loc {bounds} must end at num_tokens {q.shape[0]} and give one request per "
                         f"cache_indices / has_initial_state entry ({len(cache_indices)}, {len(has_initial_state)}).")
    if cpu_dispatch.use_kernels() and _kernel_form(q, k, v, ssm_state):
        slots = kernel_slot_indices(cache_indices, len(bounds) - 1)
        return cpu_kernels.gated_delta_rule_prefill(q, k, v, g, beta, ssm_state, query_start_loc.contiguous(), slots,
                                                    has_initial_state, _scale(q, scale), use_qk_l2norm_in_kernel)
    return chunk_gated_delta_rule_native(q, k, v, g, beta, ssm_state, bounds, cache_indices.tolist(),
                                         has_initial_state.tolist(), scale, use_qk_l2norm_in_kernel, chunk_size)


def chunk_gated_delta_rule_native(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    ssm_state: torch.Tensor, bounds: list[int], slots: list[int], has_initial_state: list[bool],
    scale: Optional[float] = None, use_qk_l2norm: bool = False, chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """``chunk_gated_delta_rule`` in PyTorch (every device; the C++ kernel's reference), with
    the request bounds, slots and initial-state flags as lists, arguments checked by the caller."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale, use_qk_l2norm)
    for (start, end), slot, initial in zip(zip(bounds, bounds[1:]), slots, has_initial_state):
        if end == start:
            continue
        if initial:
            state = ssm_state[slot].to(torch.float32)
        else:
            state = torch.zeros(ssm_state.shape[1:], dtype=torch.float32, device=ssm_state.device)
        tokens = slice(start, end)
        o, final = _chunk_scan(q[:, tokens], k[:, tokens], v[:, tokens], g[:, tokens], beta[:, tokens], state,
                               chunk_size)
        out[tokens] = o.transpose(0, 1)
        ssm_state[slot] = final.to(ssm_state.dtype)
    return out.to(dtype)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    ssm_state: torch.Tensor, cache_indices: torch.Tensor, scale: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> torch.Tensor:
    """One step of the gated delta rule for decode: one token per request, request r's state at
    ``ssm_state[cache_indices[r]]`` updated in place.

    Args:
        q, k: [num_reqs, num_k_heads, head_k_dim]; v: [num_reqs, num_v_heads, head_v_dim];
            g, beta: [num_reqs, num_v_heads]; ssm_state, scale, use_qk_l2norm_in_kernel as
            ``chunk_gated_delta_rule``'s; cache_indices: int [num_reqs].

    Returns:
        [num_reqs, num_v_heads, head_v_dim] in v's dtype.

    Raises:
        ValueError: shapes that do not agree.
    """
    _check_inputs(q, k, v, g, beta, ssm_state)
    if len(cache_indices) != q.shape[0]:
        raise ValueError(f"cache_indices has {len(cache_indices)} entries for {q.shape[0]} tokens (one per request).")
    if cpu_dispatch.use_kernels() and _kernel_form(q, k, v, ssm_state):
        return cpu_kernels.gated_delta_rule_decode(q, k, v, g, beta, ssm_state,
                                                   kernel_slot_indices(cache_indices, q.shape[0]), _scale(q, scale),
                                                   use_qk_l2norm_in_kernel)
    return fused_recurrent_gated_delta_rule_native(q, k, v, g, beta, ssm_state, cache_indices.long(), scale,
                                                   use_qk_l2norm_in_kernel)


def fused_recurrent_gated_delta_rule_native(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    ssm_state: torch.Tensor, cache_indices: torch.Tensor, scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """``fused_recurrent_gated_delta_rule`` in PyTorch (every device; the C++ kernel's
    reference), arguments checked by the caller, ``cache_indices`` int64."""
    dtype = v.dtype
    q, k, v, g, beta = (x.transpose(0, 1) for x in _heads_first(q, k, v, g, beta, scale, use_qk_l2norm))
    state = ssm_state[cache_indices].to(torch.float32) * g.exp()[..., None, None]  # [N, HV, K, V]
    delta = (v - (state * k.unsqueeze(-1)).sum(dim=-2)) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    ssm_state[cache_indices] = state.to(ssm_state.dtype)
    return (state * q.unsqueeze(-1)).sum(dim=-2).to(dtype)
