"""Depthwise causal conv1d of a Mamba-2 mixer over a varlen batch: prefill chunks
(``causal_conv1d_fn``) and one-token decode steps (``causal_conv1d_update``), with per-request
conv states kept in a state cache of slots.

Each channel ``d`` of a request's tokens ``x_0 .. x_{L-1}`` becomes
``out_t[d] = act(bias[d] + sum_k weight[d, k] * u_{t - (width - 1) + k}[d])``, where ``u``
is the request's conv state (its last ``width - 1`` inputs, oldest first) followed by its
tokens: the behaviour of ``torch.nn.Conv1d(groups=dim, padding=width - 1)`` in transformers'
``Mamba2Mixer`` and of vLLM's ``causal_conv1d_fn`` / ``causal_conv1d_update``, with tokens
laid out ``[num_tokens, dim]`` as the model runner lays them out. Sums are float32; outputs
are rounded once to ``x``'s dtype, states to the cache's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.mamba.ops import cpu_dispatch
from pagedllm.model_executor.layers.mamba.ops.slots import kernel_slot_indices, slot_indices

_ACTIVATIONS = (None, "silu", "swish")


def _check_activation(activation: Optional[str]) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


def _check_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], conv_states: torch.Tensor) -> int:
    """The conv width; ValueError on inconsistent shapes."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [dim, width], got {tuple(weight.shape)}")
    dim, width = weight.shape
    if width < 2:
        raise ValueError(f"the conv width must be at least 2, got {width}")
    if x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"x must be [num_tokens, {dim}], got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must be [{dim}], got {tuple(bias.shape)}")
    if conv_states.dim() != 3 or tuple(conv_states.shape[1:]) != (dim, width - 1):
        raise ValueError(f"conv_states must be [num_slots, {dim}, {width - 1}], got {tuple(conv_states.shape)}")
    return width


def _finish(acc: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str],
            dtype: torch.dtype) -> torch.Tensor:
    """``act(acc + bias)`` rounded to ``dtype`` (acc float32)."""
    if bias is not None:
        acc = acc + bias.float()
    if activation is not None:
        acc = F.silu(acc)
    return acc.to(dtype)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Causal depthwise conv over each request's tokens (prefill chunks), in one call.

    Args:
        x: [num_tokens, dim], requests contiguous along tokens.
        weight: [dim, width]; bias: [dim] or None.
        conv_states: [num_slots, dim, width - 1], the state cache; request ``r`` starts from
            ``conv_states[cache_indices[r]]`` when ``has_initial_state[r]`` (else zeros), and
            its last ``width - 1`` inputs (state included when it has fewer tokens) are
            written back there, in place.
        query_start_loc: int [num_reqs + 1], request ``r`` is tokens
            ``query_start_loc[r] : query_start_loc[r + 1]`` (non-decreasing, ending at num_tokens).
        cache_indices: int [num_reqs], each request's slot; None: slot ``r`` for request ``r``.
        has_initial_state: bool [num_reqs]; None: no request has one.
        activation: None, or "silu" / "swish" (the same function).

    Returns:
        [num_tokens, dim] in ``x``'s dtype.

    Raises:
        ValueError: on inconsistent shapes or an unknown activation.
    """
    _check_activation(activation)
    width = _check_conv(x, weight, bias, conv_states)
    num_tokens, dim = x.shape
    num_reqs = query_start_loc.numel() - 1
    if num_reqs < 0:
        raise ValueError("query_start_loc must have num_reqs + 1 entries")
    cache_indices = slot_indices(cache_indices, num_reqs, x.device)
    starts = query_start_loc.to(device=x.device, dtype=torch.long)
    lens = starts[1:] - starts[:-1]
    keep = width - 1
    req = torch.repeat_interleave(torch.arange(num_reqs, device=x.device), lens, output_size=num_tokens)
    # ``ext`` holds, per request, its ``keep`` state columns and then its tokens.
    token_pos = torch.arange(num_tokens, device=x.device) + (req + 1) * keep
    ext = torch.zeros(num_tokens + num_reqs * keep, dim, device=x.device, dtype=torch.float32)
    ext[token_pos] = x.float()
    seg_start = starts[:-1] + torch.arange(num_reqs, device=x.device) * keep
    state_pos = seg_start[:, None] + torch.arange(keep, device=x.device)
    if has_initial_state is not None:  # (a fresh slot may hold anything, NaN included: not read)
        init = conv_states[cache_indices].float().transpose(1, 2)  # [num_reqs, keep, dim]
        ext[state_pos] = init.masked_fill(~has_initial_state.to(device=x.device, dtype=torch.bool)[:, None, None], 0.0)
    # Every token's window lies within its request's part of ``ext``: one depthwise conv over
    # all of it, read at the tokens' positions.
    conv = F.conv1d(ext.T.unsqueeze(0), weight.float().unsqueeze(1), groups=dim)[0]  # [dim, len(ext) - keep]
    out = _finish(conv[:, token_pos - keep].T, bias, activation, x.dtype)
    last = ext[(seg_start + lens)[:, None] + torch.arange(keep, device=x.device)]  # [num_reqs, keep, dim]
    conv_states[cache_indices] = last.transpose(1, 2).to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    cache_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One decode step of the causal conv: each request's one token against its state,
    and the state rolled by one (oldest input dropped, ``x`` appended), in place.

    Args:
        x: [num_reqs, dim], one token per request.
        conv_states: [num_slots, dim, width - 1], the state cache.
        weight: [dim, width]; bias: [dim] or None.
        activation: None, or "silu" / "swish".
        cache_indices: int [num_reqs], each request's slot; None: slot ``r`` for request ``r``.

    Returns:
        [num_reqs, dim] in ``x``'s dtype. On CPU the C++ kernel runs where
        ``cpu_dispatch.use_kernels()`` (x, weight, bias and the cache of one dtype), else
        ``causal_conv1d_update_native``.

    Raises:
        ValueError: on inconsistent shapes or an unknown activation.
    """
    _check_activation(activation)
    _check_conv(x, weight, bias, conv_states)
    if cpu_dispatch.use_kernels() and _kernel_form(x, conv_states, weight, bias):
        slots = kernel_slot_indices(cache_indices, x.shape[0])
        return cpu_kernels.causal_conv1d_update(x, conv_states, weight, bias, activation is not None, slots)
    cache_indices = slot_indices(cache_indices, x.shape[0], x.device)
    return causal_conv1d_update_native(x, conv_states, weight, bias, activation, cache_indices)


def causal_conv1d_update_native(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
    cache_indices: torch.Tensor,
) -> torch.Tensor:
    """``causal_conv1d_update`` in PyTorch (every device; the C++ kernel's reference),
    arguments checked by the caller."""
    window = torch.cat((conv_states[cache_indices].float(), x.float()[:, :, None]), dim=2)  # [num_reqs, dim, width]
    out = _finish((window * weight.float()).sum(dim=2), bias, activation, x.dtype)
    conv_states[cache_indices] = window[:, :, 1:].to(conv_states.dtype)
    return out


def _kernel_form(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> bool:
    """Whether the C++ kernel takes these tensors: one dtype, the kernel's contiguity."""
    return (
        conv_states.dtype == x.dtype == weight.dtype
        and (bias is None or bias.dtype == x.dtype)
        and x.stride(1) == 1
        and conv_states.stride(2) == 1
        and weight.is_contiguous()
    )
