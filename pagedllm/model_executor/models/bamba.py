"""Bamba (``BambaForCausalLM``): Llama's pre-norm decoder layers whose mixing block is a
Mamba-2 mixer (``MambaMixer2``, the ``mamba`` of the checkpoint) on every layer but those of
``attn_layer_indices``, which attend as Llama does with rope on the first half of each head
(transformers' ``modeling_bamba``, ``partial_rotary_factor`` 0.5; our own code on the shared
blocks: ``LlamaModel.make_layer``, ``DecoderLayer``). The mixer layers keep their state in the
state cache, the attention layers their KV in the paged cache."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.arch_config import state_layer_indices
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2, mamba2_state_shape
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.llama import DecoderLayer, LlamaAttention, LlamaForCausalLM, LlamaModel, NormNames
from pagedllm.model_executor.models.phi3 import partial_rope

#: ``input_layernorm`` before the mixer or attention, ``pre_ff_layernorm`` before the MLP.
BAMBA_NORMS = NormNames("input_layernorm", None, "pre_ff_layernorm", None)
#: Checkpoint name part -> this model's (the shared ``DecoderLayer`` calls its blocks
#: ``self_attn`` and ``mlp``).
_NAME_PARTS = ((".mamba.", ".self_attn."), (".feed_forward.", ".mlp."), ("model.final_layernorm.", "model.norm."))


class BambaMixer(MambaMixer2):
    """``MambaMixer2`` of Bamba's config keys (``mamba_*``), called as an attention block is
    (``forward(rope, hidden_states)``; a state needs no positions)."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__(
            config.hidden_size, int(config.mamba_expand * config.hidden_size), config.mamba_n_heads,
            config.mamba_d_head, config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv,
            config.mamba_chunk_size, config.mamba_conv_bias, config.mamba_proj_bias, config.rms_norm_eps,
            config.time_step_limit, quant_config, prefix,
        )

    def forward(self, rope, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        del rope
        return super().forward(hidden_states)


class BambaModel(LlamaModel):
    def rotary_embeddings(self, config: PretrainedConfig) -> tuple[list[nn.Module], list[int]]:
        return partial_rope(config, is_neox_style=True)

    def make_layer(self, config, layer_idx, rotary_emb, sliding_window, quant_config, prefix):
        if layer_idx in state_layer_indices(config):
            block: nn.Module = BambaMixer(config, quant_config, f"{prefix}.mamba")
        else:
            block = LlamaAttention(config, self.qkv_bias, False, rotary_emb, quant_config, f"{prefix}.self_attn")
        mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.feed_forward")
        return DecoderLayer(block, mlp, BAMBA_NORMS, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))


class BambaForCausalLM(LlamaForCausalLM):
    """Bamba (``LlamaForCausalLM``'s interface; checkpoint names ``mamba`` / ``feed_forward`` /
    ``final_layernorm`` read as the shared layers' ``self_attn`` / ``mlp`` / ``norm``). ``get_mamba_state_shape_from_config``
    / ``get_mamba_state_dtype_from_config`` (vLLM's names): a mixer layer's state."""

    model_cls = BambaModel
    mamba_type = "mamba2"

    @classmethod
    def get_mamba_state_shape_from_config(cls, config: PretrainedConfig,
                                          tp_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """A mixer layer's (conv, ssm) state shapes per slot on each of ``tp_size`` ranks
        (``mamba2_state_shape``)."""
        return mamba2_state_shape(int(config.mamba_expand * config.hidden_size), config.mamba_n_groups,
                                  config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state, config.mamba_d_conv,
                                  tp_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, config: PretrainedConfig, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The states' dtypes: the model's ``dtype`` for both (vLLM's "auto")."""
        return dtype, dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((_our_name(name), tensor) for name, tensor in weights)


def _our_name(name: str) -> str:
    for checkpoint_part, our_part in _NAME_PARTS:
        name = name.replace(checkpoint_part, our_part)
    return name
