"""Qwen3.5's language models (transformers' ``Qwen3_5ForCausalLM``, dense, and
``Qwen3_5MoeForCausalLM``): Qwen3-Next's decoder (``qwen3_next``) whose Gated DeltaNet layers
project with separate ``in_proj_qkv`` ([q | k | v], not grouped by key head), ``in_proj_z``,
``in_proj_b`` and ``in_proj_a``; a dense SwiGLU MLP on every layer (Qwen3.5), or routed experts
(renormalised top-k) plus a sigmoid-gated shared expert on every layer (Qwen3.5-MoE). Text
positions make their multimodal rope the plain partial rope.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.distributed import get_tensor_model_parallel_world_size
from pagedllm.model_executor.layers.linear import ColumnParallelLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.llama import make_llama_mlp
from pagedllm.model_executor.models.llama_moe import SparseMoeBlock
from pagedllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM, Qwen3NextLinearAttention, Qwen3NextModel


class Qwen3_5LinearAttention(Qwen3NextLinearAttention):
    """Qwen3.5's Gated DeltaNet (transformers' ``Qwen3_5GatedDeltaNet``): its own projections
    (``in_proj_qkv`` column-parallel by part of [q | k | v])."""

    def make_projections(self, hidden: int, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.in_proj_qkv = ColumnParallelLinear(
            hidden, self.conv_dim * tp_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.in_proj_qkv",
            output_sizes=[self.key_dim * tp_size, self.key_dim * tp_size, self.value_dim * tp_size])
        for name, size in (("in_proj_z", self.value_dim), ("in_proj_b", self.num_v_heads),
                           ("in_proj_a", self.num_v_heads)):
            setattr(self, name, ColumnParallelLinear(hidden, size * tp_size, bias=False, quant_config=quant_config,
                                                     prefix=f"{prefix}.{name}"))

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = self.in_proj_z(hidden_states).view(hidden_states.shape[0], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(hidden_states), z, self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)


class Qwen3_5Model(Qwen3NextModel):
    linear_attention_cls = Qwen3_5LinearAttention


def make_qwen3_5_moe_mlp(config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                         prefix: str) -> nn.Module:
    """Every layer's experts (renormalised top-k) with the gated shared expert."""
    return SparseMoeBlock(config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, True,
                          quant_config, prefix, shared_expert_intermediate_size=config.shared_expert_intermediate_size)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5, dense (``Qwen3NextForCausalLM``'s interface and loading)."""

    model_cls = Qwen3_5Model
    make_mlp = staticmethod(make_llama_mlp)


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE (``Qwen3NextForCausalLM``'s interface and loading)."""

    model_cls = Qwen3_5Model
    make_mlp = staticmethod(make_qwen3_5_moe_mlp)
