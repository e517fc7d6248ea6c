"""The Gated DeltaNet layer (Qwen3-Next's linear attention; transformers'
``Qwen3NextGatedDeltaNet``, vLLM's ``Qwen3NextGatedDeltaNet``), over the runner's varlen batch
with per-request state slots.

Per token: ``in_proj_qkvz`` gives q, k, v and the output gate z and ``in_proj_ba`` beta's and
the decay's logits b, a, both grouped by key head as the checkpoints store them; a depthwise
causal conv1d (width ``linear_conv_kernel_dim``, then silu) runs over [q | k | v]; then
beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule
(``mamba.ops.gated_delta``, q/k L2-normed), ``RMSNormGated`` per value head with z, and
``out_proj``.

A state layer (``mamba.abstract.MambaBase``): per request slot (``get_state_shape``) the conv
state [conv_dim, width - 1] (the conv's last inputs) and the recurrent state [num_v_heads,
head_k_dim, head_v_dim]; the runner binds ``kv_cache`` = [conv_state, ssm_state], each with a
leading slot dimension, and the forward context's ``MambaMetadata`` of the layer's state group
gives each request's slot and whether it starts from it (decodes first, one token each).

Under tensor parallelism each rank holds ``linear_num_key_heads / tp_size`` key heads and their
value heads (vLLM's split): the input projections are column-parallel (Qwen3-Next's rows are
grouped by key head, so each rank's rows are consecutive; Qwen3.5's [q | k | v] splits part by
part), the conv, dt_bias, A_log and the states hold this rank's channels and heads, ``out_proj``
is row-parallel; the norm (per value head) is whole on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.metadata import get_forward_context
from pagedllm.distributed import divide, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.mamba.abstract import MambaBase, MambaMetadata
from pagedllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from pagedllm.model_executor.layers.mamba.ops.gated_delta import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)
from pagedllm.model_executor.layers.mamba.sharding import head_weight_loader, segmented_weight_loader
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.utils import set_weight_attrs


def gated_deltanet_state_shape(config: PretrainedConfig,
                               tp_size: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """The per-slot shapes of a Gated DeltaNet layer's (conv_state, ssm_state) for ``config`` on
    each of ``tp_size`` ranks: (conv_dim, linear_conv_kernel_dim - 1), conv_dim = 2 x key heads
    x key dim + value heads x value dim, and (value heads, linear_key_head_dim,
    linear_value_head_dim), with the rank's heads (``linear_num_*_heads / tp_size``).

    Raises:
        ValueError: key heads not divisible by ``tp_size``.
    """
    key_heads = divide(config.linear_num_key_heads, tp_size)
    value_heads = key_heads * (config.linear_num_value_heads // config.linear_num_key_heads)
    conv_dim = 2 * key_heads * config.linear_key_head_dim + value_heads * config.linear_value_head_dim
    return ((conv_dim, config.linear_conv_kernel_dim - 1),
            (value_heads, config.linear_key_head_dim, config.linear_value_head_dim))


class RMSNormGated(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) * silu(gate) over the last dimension, the norm in
    float32 and rounded to x's dtype before the weight, the gate in float32 (transformers'
    ``Qwen3NextRMSNormGated``; norm before gate). ``weight`` is the scale itself (ones)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., hidden_size] -> [..., hidden_size] in x's dtype."""
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(MambaBase):
    """Qwen3-Next's linear-attention token mixer: hidden_states [T, hidden] -> [T, hidden].

    Config keys (transformers' ``Qwen3NextConfig``): ``linear_num_key_heads``,
    ``linear_num_value_heads`` (a multiple of them), ``linear_key_head_dim``,
    ``linear_value_head_dim``, ``linear_conv_kernel_dim``, ``hidden_act`` (the conv's
    activation, "silu"), ``rms_norm_eps``.

    Head counts and dims (``num_k_heads``, ``key_dim``, ``conv_dim`` ...) are this rank's.

    Raises:
        ValueError: value heads not a multiple of key heads, or key heads not divisible by the
            tensor-parallel size.
    """

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        total_k_heads, total_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if total_v_heads % total_k_heads:
            raise ValueError(f"linear_num_value_heads {total_v_heads} is not a multiple of "
                             f"linear_num_key_heads {total_k_heads}.")
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.num_k_heads = divide(total_k_heads, tp_size)
        self.num_v_heads = self.num_k_heads * (total_v_heads // total_k_heads)
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.activation = config.hidden_act
        hidden = config.hidden_size
        self.make_projections(hidden, quant_config, prefix)
        # The checkpoint's nn.Conv1d weight [conv_dim, 1, width], no bias.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.conv_kernel_size), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        # The conv's channels [q | k | v] and the per-value-head vectors: this rank's part of each.
        conv_loader = segmented_weight_loader([(self.key_dim, tp_rank, tp_size), (self.key_dim, tp_rank, tp_size),
                                               (self.value_dim, tp_rank, tp_size)])
        set_weight_attrs(self.conv1d.weight, {"weight_loader": conv_loader})
        for param in (self.dt_bias, self.A_log):
            set_weight_attrs(param, {"weight_loader": head_weight_loader(total_v_heads, tp_size, tp_rank)})
        self.norm = RMSNormGated(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(total_v_heads * self.head_v_dim, hidden, bias=False,
                                          quant_config=quant_config, prefix=f"{prefix}.out_proj")
        self.state_shape = gated_deltanet_state_shape(config, tp_size)
        #: The states' dtype: the parameters' (the model dtype), as vLLM's "auto" state dtypes.
        self.state_dtype = torch.get_default_dtype()

    def make_projections(self, hidden: int, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        """The input projections ``project`` reads: Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``."""
        tp_size = get_tensor_model_parallel_world_size()
        self.in_proj_qkvz = ColumnParallelLinear(hidden, (self.conv_dim + self.value_dim) * tp_size, bias=False,
                                                 quant_config=quant_config, prefix=f"{prefix}.in_proj_qkvz")
        self.in_proj_ba = ColumnParallelLinear(hidden, 2 * self.num_v_heads * tp_size, bias=False,
                                               quant_config=quant_config, prefix=f"{prefix}.in_proj_ba")

    def get_state_shape(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """The per-slot shapes of (conv_state, ssm_state) (``gated_deltanet_state_shape``)."""
        return self.state_shape

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        """The dtypes of (conv_state, ssm_state): the model dtype for both."""
        return self.state_dtype, self.state_dtype

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, hidden] -> [T, hidden], over the bound ``kv_cache`` states and the
        forward context's state metadata (see the module docstring)."""
        conv_state, ssm_state = self.kv_cache
        return self.mix(hidden_states, conv_state, ssm_state, get_forward_context(self.kv_cache_group_id))

    def mix(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
            metadata: MambaMetadata) -> torch.Tensor:
        """``forward`` on explicit states: conv_state [slots, conv_dim, width - 1] and ssm_state
        [slots, num_v_heads, head_k_dim, head_v_dim], read and written at the slots of
        ``metadata`` (``query_start_loc``, ``state_indices``, ``has_initial_state``,
        ``num_decodes``: the first requests, one token each)."""
        num_tokens = hidden_states.shape[0]
        mixed_qkv, z, b, a = self.project(hidden_states)
        weight = self.conv1d.weight.squeeze(1)
        num_decodes = int(metadata.num_decodes)
        slots = metadata.state_indices
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = torch.empty(num_tokens, self.num_v_heads, self.head_v_dim, dtype=hidden_states.dtype,
                           device=hidden_states.device)
        if num_decodes:
            d = slice(0, num_decodes)
            qkv = causal_conv1d_update(mixed_qkv[d], conv_state, weight, None, self.activation, slots[d])
            core[d] = fused_recurrent_gated_delta_rule(*self._split_heads(qkv), g[d], beta[d], ssm_state, slots[d],
                                                       use_qk_l2norm_in_kernel=True)
        if num_decodes < num_tokens:
            p = slice(num_decodes, num_tokens)
            query_start_loc = metadata.prefill_query_start_loc
            prefill_slots, initial = slots[num_decodes:], metadata.has_initial_state[num_decodes:]
            qkv = causal_conv1d_fn(mixed_qkv[p], weight, None, conv_state, query_start_loc, prefill_slots, initial,
                                   self.activation)
            core[p] = chunk_gated_delta_rule(*self._split_heads(qkv), g[p], beta[p], ssm_state, query_start_loc,
                                             prefill_slots, initial, use_qk_l2norm_in_kernel=True)
        core = self.norm(core, z)
        return self.out_proj(core.reshape(num_tokens, self.value_dim))

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed_qkv [T, conv_dim] as [q | k | v], z [T, HV, head_v_dim], b, a [T, HV]) from the
        projections, whose features Qwen3-Next groups by key head: per group [q | k | v | z] and
        [b | a]."""
        num_tokens, group = hidden_states.shape[0], self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(hidden_states).view(num_tokens, self.num_k_heads, -1)
        ba = self.in_proj_ba(hidden_states).view(num_tokens, self.num_k_heads, 2 * group)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, group * self.head_v_dim, group * self.head_v_dim],
                                dim=-1)
        mixed_qkv = torch.cat([x.reshape(num_tokens, -1) for x in (q, k, v)], dim=-1)
        b, a = (x.reshape(num_tokens, self.num_v_heads) for x in ba.split([group, group], dim=-1))
        return mixed_qkv, z.reshape(num_tokens, self.num_v_heads, self.head_v_dim), b, a

    def _split_heads(self, mixed_qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, conv_dim] -> q, k [T, num_k_heads, head_k_dim], v [T, num_v_heads, head_v_dim]."""
        num_tokens = mixed_qkv.shape[0]
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
                k.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
                v.reshape(num_tokens, self.num_v_heads, self.head_v_dim))
