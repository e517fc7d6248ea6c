"""GLM-4 (``Glm4ForCausalLM``, the 0414 models): Llama's blocks with a norm after the
attention (``post_self_attn_layernorm``) and after the MLP (``post_mlp_layernorm``) as well
as before each, q/k/v bias by ``attention_bias`` (none on o_proj), gate/up fused in the
checkpoint, and rope on the first ``partial_rotary_factor`` of each head's channels in
interleaved pairs (transformers' ``modeling_glm4``)."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.models.llama import DecoderLayer, LlamaAttention, LlamaForCausalLM, LlamaModel, NormNames
from pagedllm.model_executor.models.phi3 import partial_rope

#: Norms before and after each block, as GLM-4's checkpoints name them.
GLM4_NORMS = NormNames("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4Model(LlamaModel):
    def rotary_embeddings(self, config: PretrainedConfig) -> tuple[list[nn.Module], list[int]]:
        return partial_rope(config, is_neox_style=False)

    def make_layer(self, config, layer_idx, rotary_emb, sliding_window, quant_config, prefix):
        attn = LlamaAttention(config, self.qkv_bias, False, rotary_emb, quant_config, f"{prefix}.self_attn", o_bias=False)
        mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        return DecoderLayer(attn, mlp, GLM4_NORMS, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))


class Glm4ForCausalLM(LlamaForCausalLM):
    """GLM-4 (``LlamaForCausalLM``'s interface; the fused gate_up_proj needs no mapping)."""

    model_cls = Glm4Model
