"""Mixtral (transformers' ``MixtralForCausalLM``): Mistral's decoder (a ``sliding_window``
on every layer when set) with a mixture of experts on every layer: softmax router over
``num_local_experts``, ``num_experts_per_tok`` experts per token, their weights renormalised.

Checkpoint names: ``block_sparse_moe.gate`` (the router) and ``block_sparse_moe.experts.<e>.w1``
(gate) / ``w3`` (up) / ``w2`` (down), or the stacked ``experts.gate_up_proj`` / ``down_proj``.
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.llama_moe import LlamaMoEForCausalLM, SparseMoeBlock


def make_mixtral_moe(config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                     prefix: str) -> nn.Module:
    """Every layer's feed-forward block: the experts (``llama.MakeMLP``)."""
    return SparseMoeBlock(config, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                          True, quant_config, prefix)


class MixtralForCausalLM(LlamaMoEForCausalLM):
    make_mlp = staticmethod(make_mixtral_moe)
    expert_projections = {"w1": "w1", "w2": "w2", "w3": "w3"}
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)
