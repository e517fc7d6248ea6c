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

Under tensor parallelism each rank holds ``nheads / tp_size`` heads and their B / C groups
(``mamba.sharding``): ``in_proj`` is column-parallel by part of [z | x | B | C | dt],
``out_proj`` row-parallel, and the conv, A, D, dt_bias, the norm and the states hold this
rank's channels; a norm group copied on several ranks sums its squares over them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import get_forward_context
from pagedllm.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.mamba.abstract import MambaBase, MambaMetadata
from pagedllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from pagedllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update
from pagedllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined
from pagedllm.model_executor.layers.mamba.sharding import GroupShards, head_weight_loader, segmented_weight_loader
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.utils import set_weight_attrs


def mamba2_state_shape(intermediate_size: int, n_groups: int, num_heads: int, head_dim: int, state_size: int,
                       conv_kernel: int, tp_size: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv state shape, ssm state shape) of one Mamba-2 layer's slot on each of ``tp_size``
    ranks: ``(conv_dim, conv_kernel - 1)`` with conv_dim = intermediate / tp_size + 2 x the
    rank's groups x d_state, and ``(nheads / tp_size, head_dim, d_state)`` (vLLM's
    ``MambaStateShapeCalculator.mamba2_state_shape``).

    Raises:
        ValueError: heads or groups that do not split over ``tp_size`` ranks.
    """
    heads, groups = divide(num_heads, tp_size), GroupShards.of(n_groups, tp_size, 0).per_rank
    conv_dim = divide(intermediate_size, tp_size) + 2 * groups * state_size
    return (conv_dim, conv_kernel - 1), (heads, head_dim, state_size)


class Mixer2RMSNormGated(nn.Module):
    """y = rms_norm(x x silu(z)) x weight, the RMS taken over each of ``n_groups`` equal
    channel groups, in float32 (transformers' ``MambaRMSNormGated``; gate before the norm).
    ``norm_before_gate``: y = rms_norm(x) x weight x silu(z) instead (Falcon-H1's
    ``mamba_norm_before_gate``, transformers' ``FalconH1RMSNormGated``).

    ``hidden_size`` and ``n_groups`` are this rank's; ``ranks_per_group`` > 1 (one group on the
    rank): the group's channels span that many consecutive tensor-parallel ranks (this rank's
    ``tp_rank``), and its mean square sums over them (an all-gather of one float per token)."""

    def __init__(self, hidden_size: int, n_groups: int, eps: float, norm_before_gate: bool = False,
                 ranks_per_group: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        if hidden_size % n_groups or (ranks_per_group > 1 and n_groups != 1):
            raise ValueError(f"n_groups {n_groups} must divide the mixer's {hidden_size} channels (one group when "
                             f"it spans {ranks_per_group} ranks).")
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.group_size = hidden_size // n_groups
        self.variance_epsilon = eps
        self.norm_before_gate = norm_before_gate
        self.ranks_per_group, self.group_index = ranks_per_group, tp_rank // ranks_per_group

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [T, hidden] -> [T, hidden] in x's dtype."""
        h = x.float() if self.norm_before_gate else x.float() * F.silu(gate.float())
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(self._mean_square(grouped) + self.variance_epsilon)
        if self.norm_before_gate:
            return (self.weight * grouped.view_as(h) * F.silu(gate.float())).to(x.dtype)
        return self.weight * grouped.view_as(h).to(x.dtype)

    def _mean_square(self, grouped: torch.Tensor) -> torch.Tensor:
        """[T, groups, group_size] -> [T, groups, 1]: the mean square of each group's channels
        (over the ranks that share it)."""
        if self.ranks_per_group == 1:
            return grouped.pow(2).mean(-1, keepdim=True)
        sums = tensor_model_parallel_all_gather(grouped.pow(2).sum(-1))  # [T, tp_size]
        mine = sums.view(sums.shape[0], -1, self.ranks_per_group)[:, self.group_index]
        return (mine.sum(-1) / (self.group_size * self.ranks_per_group))[:, None, None]


class Mamba2InProj(ColumnParallelLinear):
    """Mamba-2's ``in_proj``, column-parallel by part of its outputs [z | x | B | C | dt]: this
    rank's heads' z, x and dt, and its groups' B and C (``groups``, copies where the groups
    are fewer than the ranks). ``kwargs``: ``LinearBase``'s."""

    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int, num_heads: int,
                 groups: GroupShards, bias: bool, **kwargs: Any) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        group_rows = groups.per_rank * state_size * tp_size  # over all ranks, copies counted (as QKV's)
        sizes = [intermediate_size, intermediate_size, group_rows, group_rows, num_heads]
        super().__init__(hidden_size, sum(sizes), bias, output_sizes=sizes, **kwargs)
        self.groups = groups

    def output_part(self, index: int) -> tuple[int, int]:
        if index in (2, 3):
            return self.groups.part, self.groups.num_parts
        return self.tp_rank, self.tp_size


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
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        groups = GroupShards.of(n_groups, tp_size, tp_rank)
        # This rank's part (all of it at tensor-parallel size 1).
        self.num_heads, self.head_dim = divide(num_heads, tp_size), head_dim
        self.intermediate_size = self.num_heads * head_dim
        self.n_groups, self.state_size, self.chunk_size = groups.per_rank, state_size, chunk_size
        group_rows = groups.per_rank * state_size
        self.conv_dim = self.intermediate_size + 2 * group_rows
        self.time_step_limit = tuple(time_step_limit) if time_step_limit is not None else (0.0, math.inf)
        self.in_proj = Mamba2InProj(hidden_size, intermediate_size, state_size, num_heads, groups, use_bias,
                                    quant_config=quant_config, prefix=f"{prefix}.in_proj")
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=use_conv_bias)
        self.conv1d.requires_grad_(False)
        conv_loader = segmented_weight_loader([(self.intermediate_size, tp_rank, tp_size),
                                               (group_rows, groups.part, groups.num_parts),
                                               (group_rows, groups.part, groups.num_parts)])
        for param in (self.conv1d.weight, self.conv1d.bias):
            if param is not None:
                set_weight_attrs(param, {"weight_loader": conv_loader})
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        for param in (self.dt_bias, self.A_log, self.D):
            set_weight_attrs(param, {"weight_loader": head_weight_loader(num_heads, tp_size, tp_rank)})
        self.norm = (Mixer2RMSNormGated(self.intermediate_size, groups.per_rank, rms_norm_eps, norm_before_gate,
                                        groups.ranks_per_group, tp_rank) if rms_norm else SiluGate())
        if rms_norm:
            set_weight_attrs(self.norm.weight, {"weight_loader": head_weight_loader(num_heads, tp_size, tp_rank,
                                                                                     head_dim)})
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size,
                                          bias=use_bias if out_proj_bias is None else out_proj_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.out_proj")
        scale = None if in_proj_scale is None else self._rank_part(in_proj_scale, intermediate_size, n_groups)
        self.in_proj_scale: Optional[torch.Tensor]
        self.register_buffer("in_proj_scale", scale, persistent=False)
        self._shapes = mamba2_state_shape(intermediate_size, n_groups, num_heads, head_dim, state_size, conv_kernel,
                                          tp_size)
        self._state_dtype = torch.get_default_dtype()  # the model's dtype while it is built

    def _rank_part(self, full: torch.Tensor, intermediate_size: int, n_groups: int) -> torch.Tensor:
        """This rank's entries of a vector over the whole ``in_proj`` output [z | x | B | C | dt],
        in the model's dtype."""
        group_rows = n_groups * self.state_size
        parts = full.split([intermediate_size, intermediate_size, group_rows, group_rows, self.num_heads *
                            self.in_proj.tp_size])
        mine = [part.chunk(self.in_proj.output_part(i)[1])[self.in_proj.output_part(i)[0]]
                for i, part in enumerate(parts)]
        return torch.cat(mine).to(torch.get_default_dtype())

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
