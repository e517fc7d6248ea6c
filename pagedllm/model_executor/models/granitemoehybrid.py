"""IBM Granite 4 (``GraniteMoeHybridForCausalLM``): Granite's scaled pre-norm decoder whose
mixing block is a Mamba-2 mixer (``mamba``, Bamba's ``MambaMixer2`` of the ``mamba_*`` keys) on
the ``layer_types`` "linear_attention" layers (the Hub's "mamba") and attention elsewhere, with
rope only when ``position_embedding_type`` is "rope" (else none, "nope"); every layer's
feed-forward block is a dense SwiGLU ``shared_mlp`` of ``shared_intermediate_size``, plus
``num_local_experts`` routed experts (``block_sparse_moe``; none: dense) when there are any.
Granite's factors apply as in transformers' ``modeling_granitemoehybrid``: ``embedding_multiplier``
on the embeddings, ``residual_multiplier`` on each block's output, ``attention_multiplier`` as
the softmax scale, logits divided by ``logits_scaling``. Our own code on the shared blocks."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.arch_config import state_layer_indices
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.bamba import BambaForCausalLM, BambaMixer
from pagedllm.model_executor.models.granite import GraniteModel
from pagedllm.model_executor.models.llama import LLAMA_NORMS, DecoderLayer, LlamaAttention, LlamaMLP
from pagedllm.model_executor.models.llama_moe import LlamaMoEForCausalLM, SparseMoeBlock


class NoPositionEmbedding(nn.Module):
    """A rope table that rotates nothing (no position embedding: the attention of a state-space
    hybrid learns positions from its mixers): ``cos_sin`` gives empty tensors, ``forward``
    returns q and k as they are."""

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        empty = positions.new_empty(0, dtype=dtype)
        return empty, empty

    def forward(self, q: torch.Tensor, k: torch.Tensor, *cos_sin: torch.Tensor):
        return q, k


class GraniteMoeHybridMLP(nn.Module):
    """x [T, H] -> [T, H]: ``shared_mlp(x)`` (SwiGLU of ``shared_intermediate_size``; the
    checkpoint's ``input_linear`` is gate rows then up rows) plus, with ``num_local_experts`` > 0,
    ``block_sparse_moe(x)`` (softmax over the top ``num_experts_per_tok`` router logits)."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        self.shared_mlp = LlamaMLP(config, quant_config, f"{prefix}.shared_mlp",
                                   intermediate_size=config.shared_intermediate_size)
        self.block_sparse_moe: Optional[SparseMoeBlock] = None
        if config.num_local_experts > 0:
            self.block_sparse_moe = SparseMoeBlock(
                config, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True,
                quant_config, f"{prefix}.block_sparse_moe")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = out + self.block_sparse_moe(x)
        return out


def make_granitemoehybrid_mlp(config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                              prefix: str) -> nn.Module:
    """Every layer's feed-forward block (``MakeMLP``): ``GraniteMoeHybridMLP``."""
    return GraniteMoeHybridMLP(config, quant_config, prefix)


class GraniteMoeHybridModel(GraniteModel):
    def rotary_embeddings(self, config: PretrainedConfig) -> tuple[list[nn.Module], list[int]]:
        if config.position_embedding_type == "rope":
            return super().rotary_embeddings(config)
        return [NoPositionEmbedding()], [0] * config.num_hidden_layers

    def make_layer(self, config, layer_idx, rotary_emb, sliding_window, quant_config, prefix):
        if layer_idx in state_layer_indices(config):
            block: nn.Module = BambaMixer(config, quant_config, f"{prefix}.mamba")
        else:
            block = LlamaAttention(config, self.qkv_bias, False, rotary_emb, quant_config, f"{prefix}.self_attn",
                                   scale=float(config.attention_multiplier))
        mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        return DecoderLayer(block, mlp, LLAMA_NORMS, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
                            residual_multiplier=float(config.residual_multiplier))


class GraniteMoeHybridForCausalLM(LlamaMoEForCausalLM):
    """Granite 4 (``LlamaForCausalLM``'s interface; ``compute_logits`` divides by
    ``logits_scaling``). The mixer layers' states are Bamba's (the same ``mamba_*`` keys).
    Checkpoint names as the Hub's: ``mamba`` / ``shared_mlp`` / ``block_sparse_moe``
    (``router.layer`` [E, H], stacked ``input_linear`` [E, 2I, H] and ``output_linear`` [E, H, I])."""

    model_cls = GraniteMoeHybridModel
    make_mlp = staticmethod(make_granitemoehybrid_mlp)
    mamba_type = "mamba2"
    get_mamba_state_shape_from_config = BambaForCausalLM.get_mamba_state_shape_from_config
    get_mamba_state_dtype_from_config = BambaForCausalLM.get_mamba_state_dtype_from_config
    checkpoint_renames = (
        (".mamba.", ".self_attn."),
        (".shared_mlp.input_linear.", ".mlp.shared_mlp.gate_up_proj."),
        (".shared_mlp.output_linear.", ".mlp.shared_mlp.down_proj."),
        (".block_sparse_moe.router.layer.", ".mlp.block_sparse_moe.gate."),
        (".block_sparse_moe.input_linear.weight", ".mlp.block_sparse_moe.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".mlp.block_sparse_moe.experts.down_proj"),
    )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.config.logits_scaling
