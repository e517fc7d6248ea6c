"""Qwen3-Next (transformers' ``Qwen3NextForCausalLM``): a decoder whose layers mix tokens by
Gated DeltaNet linear attention (``layer_types`` "linear_attention", three in four with the
default ``full_attention_interval`` 4; ``pagedllm.model_executor.layers.gated_deltanet``) or by
gated full attention ("full_attention": q_proj gives each head's query and output gate, the
output times sigmoid(gate) before o_proj; per-head q/k norms; rope on the first
``partial_rotary_factor`` of each head's channels), every RMSNorm scaling by (1 + weight); the
feed-forward blocks are Qwen2-MoE's (``qwen2_moe.make_qwen2_moe_mlp``: routed experts plus a
shared expert gated by sigmoid, a dense MLP on ``mlp_only_layers``). The linear-attention layers
keep a conv and a recurrent state per request in the state cache, the others a KV cache.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.arch_config import STATE_LAYER_TYPE
from pagedllm.model_executor.layers.gated_deltanet import GatedDeltaNet, gated_deltanet_state_shape
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedllm.model_executor.models.llama import LLAMA_NORMS, DecoderLayer, LlamaAttention, LlamaModel
from pagedllm.model_executor.models.llama_moe import LlamaMoEForCausalLM
from pagedllm.model_executor.models.phi3 import partial_rope
from pagedllm.model_executor.models.qwen2_moe import make_qwen2_moe_mlp

#: The ``layer_types`` entries of a Gated DeltaNet layer and of a gated attention layer.
LINEAR_ATTENTION, FULL_ATTENTION = STATE_LAYER_TYPE, "full_attention"


class Qwen3NextAttention(LlamaAttention):
    """Gated self-attention (transformers' ``Qwen3NextAttention``): q_proj gives per head
    [query | gate] (``LlamaAttention``'s ``output_gate``), (1 + w) q/k norms per head, rope, and
    the attention output times sigmoid(gate) into o_proj; q/k/v/o biases by ``attention_bias``."""

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__(config, bool(getattr(config, "attention_bias", False)), True, rotary_emb, quant_config,
                         prefix, norm_cls=GemmaRMSNorm, output_gate=True)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, hidden] -> [T, hidden]."""
        num_tokens = hidden_states.shape[0]
        kv_size = self.qkv_proj.kv_size
        q_gate, k, v = self.qkv_proj(hidden_states).split([self.qkv_proj.q_size, kv_size, kv_size], dim=-1)
        q, gate = q_gate.reshape(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q, k = self.norm_qk(q, k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(q, k, *rope)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.contiguous())
        return self.o_proj(out * torch.sigmoid(gate.reshape(num_tokens, -1)))


class Qwen3NextLinearAttention(GatedDeltaNet):
    """``GatedDeltaNet`` in a decoder layer's token-mixer seat (``forward(rope, hidden_states)``;
    it uses no rope)."""

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states)


class Qwen3NextModel(LlamaModel):
    """The decoder stack: each layer's token mixer by its ``layer_types`` entry, (1 + w) norms."""

    norm_cls = GemmaRMSNorm
    #: The class of the "linear_attention" layers' token mixer.
    linear_attention_cls: type[GatedDeltaNet] = Qwen3NextLinearAttention

    def rotary_embeddings(self, config: PretrainedConfig) -> tuple[list[nn.Module], list[int]]:
        return partial_rope(config, is_neox_style=True)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, rotary_emb: nn.Module,
                   sliding_window: Optional[int], quant_config: Optional[QuantizationConfig], prefix: str) -> nn.Module:
        # NOTE: the token mixer sits at ``self_attn`` in both kinds of layer; the checkpoint's
        # ``linear_attn`` tensors are renamed on load (``checkpoint_renames``).
        kind = config.layer_types[layer_idx]
        if kind == LINEAR_ATTENTION:
            mixer: nn.Module = self.linear_attention_cls(config, quant_config, f"{prefix}.linear_attn")
        elif kind == FULL_ATTENTION:
            mixer = Qwen3NextAttention(config, rotary_emb, quant_config, f"{prefix}.self_attn")
        else:
            raise ValueError(f"layer_types[{layer_idx}] is {kind!r}: {type(self).__name__} builds "
                             f"{LINEAR_ATTENTION!r} and {FULL_ATTENTION!r} layers.")
        mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        return DecoderLayer(mixer, mlp, LLAMA_NORMS, lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))


class Qwen3NextForCausalLM(LlamaMoEForCausalLM):
    """Qwen3-Next (``LlamaForCausalLM``'s interface; experts loaded as ``LlamaMoEForCausalLM``'s).
    The checkpoint's multi-token-prediction head (``mtp.*``) is not loaded."""

    model_cls = Qwen3NextModel
    make_mlp = staticmethod(make_qwen2_moe_mlp)
    checkpoint_renames = ((".linear_attn.", ".self_attn."),)
    #: The kind of state its linear-attention layers keep (vLLM's name, in logs).
    mamba_type = "gdn_attention"

    @classmethod
    def get_mamba_state_shape_from_config(cls, hf_config: PretrainedConfig,
                                          tp_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """Each linear-attention layer's state shapes per slot on each of ``tp_size`` ranks
        (``gated_deltanet_state_shape``)."""
        return gated_deltanet_state_shape(hf_config, tp_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, hf_config: PretrainedConfig,
                                          dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The dtypes of those states: the model ``dtype`` for both (vLLM's "auto")."""
        return dtype, dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name, tensor) for name, tensor in weights if not name.startswith("mtp."))
