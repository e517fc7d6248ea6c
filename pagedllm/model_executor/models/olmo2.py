"""OLMo 2 (``Olmo2ForCausalLM``): Llama's blocks with RMSNorm on the whole q and k
projections (before the head split and rope) and norms after each block instead of before
(transformers' ``modeling_olmo2``; our own code on the shared decoder layers)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.distributed import get_tp_group
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.llama import DecoderLayer, LlamaAttention, LlamaForCausalLM, LlamaModel, NormNames

#: Only post-block norms: ``post_attention_layernorm`` on the attention output, ``post_feedforward_layernorm`` on the MLP's.
OLMO2_NORMS = NormNames(None, "post_attention_layernorm", None, "post_feedforward_layernorm")


class Olmo2Attention(LlamaAttention):
    """``LlamaAttention`` whose ``q_norm`` / ``k_norm`` are RMSNorms over all query / key
    channels (num_heads x head_dim), not per head. With tensor parallelism each rank holds
    the full norm weights and its heads' channels; the mean square is summed over the ranks
    (a replicated KV head counts once per replica, and so does the divisor)."""

    def __init__(self, config: PretrainedConfig, rotary_emb: nn.Module, quant_config: Optional[QuantizationConfig],
                 prefix: str) -> None:
        super().__init__(config, bool(config.attention_bias), False, rotary_emb, quant_config, prefix)
        qkv = self.qkv_proj
        self.q_norm = RMSNorm(qkv.total_num_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(qkv.total_num_kv_heads * self.head_dim, config.rms_norm_eps)
        self.tp_size = qkv.tp_size
        # This rank's channels of the norm weights: (start, size) of q and of k.
        q_part, _ = qkv.output_part(0)
        k_part, _ = qkv.output_part(1)
        self._q_channels = (q_part * qkv.q_size, qkv.q_size)
        self._k_channels = (k_part * qkv.kv_size, qkv.kv_size)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim], each normed over all its channels."""
        if self.tp_size == 1:
            return self.q_norm(q.flatten(1)).view_as(q), self.k_norm(k.flatten(1)).view_as(k)
        return (self._sharded_norm(self.q_norm, q, self._q_channels),
                self._sharded_norm(self.k_norm, k, self._k_channels))

    def _sharded_norm(self, norm: RMSNorm, x: torch.Tensor, channels: tuple[int, int]) -> torch.Tensor:
        flat = x.flatten(1).float()
        total = get_tp_group().all_reduce(flat.pow(2).sum(-1, keepdim=True))
        normed = flat * torch.rsqrt(total / (flat.shape[-1] * self.tp_size) + norm.variance_epsilon)
        start, size = channels
        return normed.to(x.dtype).mul_(norm.weight[start:start + size]).view_as(x)


class Olmo2Model(LlamaModel):
    def make_layer(self, config, layer_idx, rotary_emb, sliding_window, quant_config, prefix):
        attn = Olmo2Attention(config, rotary_emb, quant_config, f"{prefix}.self_attn")
        mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        return DecoderLayer(attn, mlp, OLMO2_NORMS, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 (``LlamaForCausalLM``'s interface and loading)."""

    model_cls = Olmo2Model
