"""Gemma 3's language model (``Gemma3ForCausalLM``, and the language model of
``Gemma3ForConditionalGeneration``, ``gemma3_mm``): Gemma 2's blocks (``gemma2``) with a
``GemmaRMSNorm`` on each query and key head, no attention soft-capping, and one rope per
layer type (``rope_parameters["sliding_attention"]`` on the windowed layers, the
"full_attention" one on the others), as transformers' ``modeling_gemma3``."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.rotary_embedding import get_rope, get_rope_parameters
from pagedllm.model_executor.models.gemma2 import Gemma2ForCausalLM, Gemma2Model


class Gemma3Model(Gemma2Model):
    attn_logit_soft_cap = False  # transformers' Gemma 3 attention does not pass it on

    def rotary_embeddings(self, config: PretrainedConfig) -> tuple[list[nn.Module], list[int]]:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kinds = sorted(set(config.layer_types))
        # max_position_embeddings is already the scaled length: the tables cover just that.
        max_position = config.max_position_embeddings
        tables = [
            get_rope(head_dim, head_dim, max_position, get_rope_parameters(config, kind), num_positions=max_position)
            for kind in kinds
        ]
        return tables, [kinds.index(kind) for kind in config.layer_types]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (``LlamaForCausalLM``'s interface and loading)."""

    qk_norm = True
    model_cls = Gemma3Model

