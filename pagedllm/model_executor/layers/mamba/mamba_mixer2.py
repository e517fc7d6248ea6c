"""The Mamba-2 mixer (vLLM's ``MambaMixer2``; the maths of transformers' ``Mamba2Mixer`` /
``BambaMixer`` ``torch_forward``) over the state cache.

Per token, ``in_proj`` gives the gate z, the conv input xBC and dt; a depthwise causal conv
(width ``conv_kernel``, SiLU) runs over xBC, which splits into x [nheads, head_dim] and
B, C [n_groups, d_state]; the selective scan (A = -exp(A_log), dt' = softplus(dt + dt_bias)
clamped to ``time_step_limit``, skip D x) gives y, normed by the gated RMSNorm
(y x silu(z), RMS over each of the n_groups channel groups) and sent through ``out_proj``.

The step's requests come decodes first (``MambaMetadata``): the decodes run the one-token
ops (``causal_conv1d_update``, ``selective_state_update``) on their slots, the prefill
chunks the varlen ops (``causal_conv1d_fn``, ``mamba_chunk_scan_combined``), continuing from
their slot where they have computed tokens, and both leave the state after their last token
in the slot. State tensors per slot: conv ``(conv_dim, conv_kernel - 1)`` and ssm
``(nheads, head_dim, d_state)``, in the model's dtype (vLLM's "auto" cache dtypes).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import get_forward_context
from pagedllm.model_executor.layers.linear import ReplicatedLinear
from pagedllm.model_executor.layers.mamba.abstract import MambaBase, MambaMetadata
from pagedllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from pagedllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update
from pagedllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined
from pagedllm.model_executor.layers.quantization import QuantizationConfig


def mamba2_state_shape(intermediate_size: int, n_groups: int, num_heads: int, head_dim: int, state_size: int,
                       conv_kernel: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv state shape, ssm state shape) of one Mamba-2 layer's slot: ``(conv_dim,
    conv_kernel - 1)`` with conv_dim = intermediate + 2 x n_groups x d_state, and
    ``(nheads, head_dim, d_state)`` (vLLM's ``MambaStateShapeCalculator.mamba2_state_shape``
    at tensor-parallel size 1)."""
    conv_dim = intermediate_size + 2 * n_groups * state_size
    return (conv_dim, conv_kernel - 1), (num_heads, head_dim, state_size)


class Mixer2RMSNormGated(nn.Module):
    """y = rms_norm(x x silu(z)) x weight, the RMS taken over each of ``n_groups`` equal
    channel groups, in float32 (transformers' ``MambaRMSNormGated``; gate before the norm).
    ``norm_before_gate``: y = rms_norm(x) x weight x silu(z) instead (Falcon-H1's
    ``mamba_norm_before_gate``, transformers' ``FalconH1RMSNormGated``)."""

    def __init__(self, hidden_size: int, n_groups: int, eps: float, norm_before_gate: bool = False) -> None:
        super().__init__()
        if hidden_size % n_groups:
            raise ValueError(f"n_groups {n_groups} must divide the mixer's {hidden_size} channels.")
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.group_size = hidden_size // n_groups
        self.variance_epsilon = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [T, hidden] -> [T, hidden] in x's dtype."""
        h = x.float() if self.norm_before_gate else x.float() * F.silu(gate.float())
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.norm_before_gate:
            return (self.weight * grouped.view_as(h) * F.silu(gate.float())).to(x.dtype)
        return self.weight * grouped.view_as(h).to(x.dtype)


class SiluGate(nn.Module):
    """y = x x silu(z), no norm (Falcon-H1 without ``mamba_rms_norm``); no parameters."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [T, hidden] -> [T, hidden] in x's dtype."""
        return x * F.silu(gate)


class MambaMixer2(MambaBase):
    """One Mamba-2 layer's mixer, ``forward(hidden_states [T, hidden]) -> [T, hidden]`` over
    the step's requests (see the module). Parameters by the checkpoint's names: ``in_proj``,
    ``conv1d`` (weight [conv_dim, 1, conv_kernel], bias), ``dt_bias``, ``A_log``, ``D``
    ([nheads] each), ``norm`` (the gated RMSNorm), ``out_proj``.

    Falcon-H1's variant (keywords): ``out_proj_bias`` (None: ``use_bias``), ``rms_norm`` False
    (y x silu(z), no norm parameter), ``norm_before_gate`` (``Mixer2RMSNormGated``'s), and
    ``in_proj_scale``, a [in_proj outputs] vector multiplying ``in_proj``'s output (its µP
    multipliers of z, x, B, C and dt; None: none).

    Raises:
        ValueError: ``num_heads x head_dim`` not the intermediate size, or heads not a
            multiple of ``n_groups``.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_heads: int, head_dim: int, n_groups: int,
        state_size: int, conv_kernel: int, chunk_size: int, use_conv_bias: bool, use_bias: bool,
        rms_norm_eps: float, time_step_limit: Optional[tuple[float, float]] = None,
        quant_config: Optional[QuantizationConfig] = None, prefix: str = "", *, out_proj_bias: Optional[bool] = None,
        rms_norm: bool = True, norm_before_gate: bool = False, in_proj_scale: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__()
        if num_heads * head_dim != intermediate_size or num_heads % n_groups:
            raise ValueError(f"Mamba-2 needs num_heads ({num_heads}) x head_dim ({head_dim}) = intermediate size "
                             f"({intermediate_size}) and num_heads a multiple of n_groups ({n_groups}).")
        self.intermediate_size, self.num_heads, self.head_dim = intermediate_size, num_heads, head_dim
        self.n_groups, self.state_size, self.chunk_size = n_groups, state_size, chunk_size
        self.conv_dim = intermediate_size + 2 * n_groups * state_size
        self.time_step_limit = tuple(time_step_limit) if time_step_limit is not None else (0.0, math.inf)
        self.in_proj = ReplicatedLinear(hidden_size, intermediate_size + self.conv_dim + num_heads, bias=use_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.in_proj")
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=use_conv_bias)
        self.conv1d.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.ones(num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(num_heads), requires_grad=False)
        self.norm = (Mixer2RMSNormGated(intermediate_size, n_groups, rms_norm_eps, norm_before_gate) if rms_norm
                     else SiluGate())
        self.out_proj = ReplicatedLinear(intermediate_size, hidden_size,
                                         bias=use_bias if out_proj_bias is None else out_proj_bias,
                                         quant_config=quant_config, prefix=f"{prefix}.out_proj")
        scale = None if in_proj_scale is None else in_proj_scale.to(torch.get_default_dtype())
        self.in_proj_scale: Optional[torch.Tensor]
        self.register_buffer("in_proj_scale", scale, persistent=False)
        self._shapes = mamba2_state_shape(intermediate_size, n_groups, num_heads, head_dim, state_size, conv_kernel)
        self._state_dtype = torch.get_default_dtype()  # the model's dtype while it is built

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self._shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self._state_dtype, self._state_dtype

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        metadata: MambaMetadata = get_forward_context(self.kv_cache_group_id)  # type: ignore[assignment]
        projected = self.in_proj(hidden_states)
        if self.in_proj_scale is not None:
            projected = projected.mul_(self.in_proj_scale)  # a fresh tensor
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        conv_state, ssm_state = self.kv_cache
        weight = self.conv1d.weight.view(self.conv_dim, -1)
        A = -torch.exp(self.A_log.float())
        nd = metadata.num_decodes
        y = torch.empty(hidden_states.shape[0], self.num_heads, self.head_dim, dtype=hidden_states.dtype,
                        device=hidden_states.device)
        if nd:
            slots = metadata.state_indices[:nd]
            xbc_d = causal_conv1d_update(xbc[:nd], conv_state, weight, self.conv1d.bias, "silu", slots)
            x, B, C = self._split(xbc_d)
            selective_state_update(ssm_state, x, dt[:nd], A, B, C, self.D, dt_bias=self.dt_bias, dt_softplus=True,
                                   state_batch_indices=slots, dt_limit=self.time_step_limit, out=y[:nd])
        if metadata.num_prefills:
            query_start_loc = metadata.prefill_query_start_loc
            slots, initial = metadata.state_indices[nd:], metadata.has_initial_state[nd:]
            xbc_p = causal_conv1d_fn(xbc[nd:], weight, self.conv1d.bias, conv_state, query_start_loc, slots, initial,
                                     "silu")
            x, B, C = self._split(xbc_p)
            mamba_chunk_scan_combined(
                x, dt[nd:], A, B, C, self.chunk_size, self.D, dt_bias=self.dt_bias, query_start_loc=query_start_loc,
                ssm_state=ssm_state, state_batch_indices=slots, has_initial_state=initial, dt_softplus=True,
                dt_limit=self.time_step_limit, out=y[nd:])
        return self.out_proj(self.norm(y.view(-1, self.intermediate_size), gate))

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [N, conv_dim] -> x [N, nheads, head_dim], B and C [N, n_groups, d_state]."""
        groups = self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, groups, groups], dim=-1)
        n = xbc.shape[0]
        return (x.reshape(n, self.num_heads, self.head_dim), B.reshape(n, self.n_groups, self.state_size),
                C.reshape(n, self.n_groups, self.state_size))
