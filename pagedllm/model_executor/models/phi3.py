"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): Llama's layer with q/k/v and gate/up fused in
the checkpoint (``qkv_proj``, ``gate_up_proj``: our fused layers load them whole, each
rank its rows), ``sliding_window`` on every layer, and the rope of ``rope_parameters``
(longrope's short / long factors) on the first ``partial_rotary_factor`` of each head's
channels, halves rotating together (transformers' ``modeling_phi3``)."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.rotary_embedding import get_rope, get_rope_parameters
from pagedllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel


def partial_rope(config: PretrainedConfig, is_neox_style: bool) -> tuple[list[nn.Module], list[int]]:
    """One rope for every layer (``LlamaModel.rotary_embeddings``' form) rotating
    ``int(head_dim * partial_rotary_factor)`` channels, as transformers computes the width."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = get_rope_parameters(config)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    table = get_rope(head_dim, rotary_dim, config.max_position_embeddings, params, is_neox_style=is_neox_style)
    return [table], [0] * config.num_hidden_layers


class Phi3Model(LlamaModel):
    def rotary_embeddings(self, config: PretrainedConfig) -> tuple[list[nn.Module], list[int]]:
        return partial_rope(config, is_neox_style=True)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 (``LlamaForCausalLM``'s interface; the fused checkpoint tensors need no mapping)."""

    model_cls = Phi3Model
