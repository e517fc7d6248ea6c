"""IBM Granite (``GraniteForCausalLM``): Llama scaled by four config factors, as transformers'
``modeling_granite`` applies them: ``embedding_multiplier`` on the embeddings,
``residual_multiplier`` on each block's output before it joins the residual stream,
``attention_multiplier`` as the softmax scale, and logits divided by ``logits_scaling``."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.models.llama import LLAMA_NORMS, DecoderLayer, LlamaAttention, LlamaForCausalLM, LlamaModel


class GraniteModel(LlamaModel):
    def embedding_scale(self, config: PretrainedConfig) -> float:
        return float(config.embedding_multiplier)

    def make_layer(self, config, layer_idx, rotary_emb, sliding_window, quant_config, prefix):
        attn = LlamaAttention(
            config, self.qkv_bias, False, rotary_emb, quant_config, f"{prefix}.self_attn",
            scale=float(config.attention_multiplier),
        )
        mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        return DecoderLayer(attn, mlp, LLAMA_NORMS, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
                            residual_multiplier=float(config.residual_multiplier))


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite (``LlamaForCausalLM``'s interface and loading); ``compute_logits`` divides by
    ``logits_scaling``."""

    model_cls = GraniteModel

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.config.logits_scaling
