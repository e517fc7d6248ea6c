"""Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``): Qwen3's decoder (per-head q/k RMSNorm,
``attention_bias``; ``sliding_window`` on every layer when ``use_sliding_window``) whose sparse
layers (``qwen2_moe.is_sparse_layer``: ``mlp_only_layers``, ``decoder_sparse_step``) hold
``num_experts`` experts of ``moe_intermediate_size`` (softmax router, ``num_experts_per_tok``
per token, renormalised with ``norm_topk_prob``; no shared expert), the others a dense MLP.
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.llama import LlamaMLP
from pagedllm.model_executor.models.llama_moe import LlamaMoEForCausalLM, SparseMoeBlock
from pagedllm.model_executor.models.qwen2_moe import is_sparse_layer


def make_qwen3_moe_mlp(config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                       prefix: str) -> nn.Module:
    """The experts on sparse layers, a dense MLP on the others."""
    if not is_sparse_layer(config, layer_idx):
        return LlamaMLP(config, quant_config, prefix)
    return SparseMoeBlock(config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                          bool(config.norm_topk_prob), quant_config, prefix)


class Qwen3MoeForCausalLM(LlamaMoEForCausalLM):
    qk_norm = True
    make_mlp = staticmethod(make_qwen3_moe_mlp)
