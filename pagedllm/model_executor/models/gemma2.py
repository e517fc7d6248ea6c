"""Gemma 2 (``Gemma2ForCausalLM``) and the Gemma blocks Gemma 3 shares (transformers'
``modeling_gemma2``; our own code on the shared decoder layers): embeddings scaled by
sqrt(hidden_size) rounded to the model dtype, (1 + w) RMSNorms (``GemmaRMSNorm``) before and
after both blocks, a GeGLU MLP (``hidden_activation``), softmax scale
``query_pre_attn_scalar ** -0.5``, ``sliding_window`` on the "sliding_attention"
``layer_types`` (alternate layers by default), attention scores soft-capped by
``attn_logit_softcapping`` and logits by ``final_logit_softcapping``."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.arch_config import GELU_ACTIVATIONS
from pagedllm.model_executor.layers.activation import GeluAndMul
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.llama import DecoderLayer, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, NormNames

#: Norms before and after each block, as Gemma's checkpoints name them.
GEMMA_NORMS = NormNames(
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
)


def make_gemma_mlp(config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                   prefix: str) -> nn.Module:
    """The GeGLU MLP (``MakeMLP``): ``GeluAndMul`` of ``hidden_activation``'s approximation."""
    return LlamaMLP(config, quant_config, prefix, act_fn=GeluAndMul(GELU_ACTIVATIONS[config.hidden_activation]))


def soft_cap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(x / cap), transformers' soft-capping (x itself when ``cap`` is None)."""
    if cap is None:
        return x
    return torch.tanh(x / cap).mul_(cap)


class Gemma2Model(LlamaModel):
    """Gemma's stack; ``attn_logit_soft_cap`` says whether the layers read ``attn_logit_softcapping``."""

    norm_cls = GemmaRMSNorm
    attn_logit_soft_cap = True

    def embedding_scale(self, config: PretrainedConfig) -> torch.Tensor:
        # A tensor in the model dtype (the default dtype while the model is built), as transformers rounds it.
        return torch.tensor(math.sqrt(config.hidden_size), dtype=torch.get_default_dtype())

    def make_layer(self, config, layer_idx, rotary_emb, sliding_window, quant_config, prefix):
        cap = config.attn_logit_softcapping if self.attn_logit_soft_cap else None
        attn = LlamaAttention(
            config, self.qkv_bias, self.qk_norm, rotary_emb, quant_config, f"{prefix}.self_attn", sliding_window,
            scale=config.query_pre_attn_scalar**-0.5, norm_cls=GemmaRMSNorm, logits_soft_cap=cap,
        )
        mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        return DecoderLayer(attn, mlp, GEMMA_NORMS, lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``LlamaForCausalLM``'s interface and loading); ``compute_logits`` soft-caps by
    ``final_logit_softcapping`` when set."""

    model_cls = Gemma2Model
    make_mlp = staticmethod(make_gemma_mlp)
    #: Whether ``compute_logits`` applies ``final_logit_softcapping`` (as transformers' class does).
    final_soft_cap = True

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        return soft_cap(logits, self.config.final_logit_softcapping if self.final_soft_cap else None)
