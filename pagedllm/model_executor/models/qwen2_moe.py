"""Qwen2-MoE (transformers' ``Qwen2MoeForCausalLM``): Qwen2's decoder (q/k/v bias, per-layer
windows from ``layer_types``) whose sparse layers hold ``num_experts`` experts of
``moe_intermediate_size`` (softmax router, ``num_experts_per_tok`` per token, renormalised
with ``norm_topk_prob``) plus a shared expert of ``shared_expert_intermediate_size`` gated by
``sigmoid(shared_expert_gate(x))``; the other layers (``mlp_only_layers``, and those off the
``decoder_sparse_step``) a dense MLP of ``intermediate_size``.
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.llama import LlamaMLP
from pagedllm.model_executor.models.llama_moe import LlamaMoEForCausalLM, SparseMoeBlock


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` holds experts: not in ``mlp_only_layers``, and every
    ``decoder_sparse_step``-th layer (1-based) of a config with experts (transformers' rule)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)


def make_qwen2_moe_mlp(config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                       prefix: str) -> nn.Module:
    """The experts and the gated shared expert on sparse layers, a dense MLP on the others."""
    if not is_sparse_layer(config, layer_idx):
        return LlamaMLP(config, quant_config, prefix)
    return SparseMoeBlock(
        config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
        bool(config.norm_topk_prob), quant_config, prefix,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size,
    )


class Qwen2MoeForCausalLM(LlamaMoEForCausalLM):
    make_mlp = staticmethod(make_qwen2_moe_mlp)

    @property
    def qkv_bias(self) -> bool:  # type: ignore[override]
        """The config's ``qkv_bias`` (q/k/v biases; True unless it says otherwise)."""
        return bool(getattr(self.config, "qkv_bias", True))
