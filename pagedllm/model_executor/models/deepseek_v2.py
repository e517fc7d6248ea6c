"""DeepSeek-V2 and DeepSeek-V3 (transformers' ``DeepseekV2ForCausalLM`` /
``DeepseekV3ForCausalLM``): the Llama decoder with multi-head latent attention
(``pagedllm.model_executor.layers.mla``) and DeepSeekMoE feed-forward blocks.

- Rope on the ``qk_rope_head_dim`` channels only: V2 rotates interleaved pairs (its complex
  product); V3 too with ``rope_interleave`` (the default), else the two halves.
- Layer ``i`` holds experts when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``
  (``moe_layer_freq`` 1 unless config.json sets it, as vLLM; transformers has no such key);
  the other layers a dense SwiGLU MLP of ``intermediate_size``.
- A sparse block: ``n_routed_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok``
  per token, plus ``n_shared_experts`` shared experts fused into one MLP of ``n_shared_experts
  x moe_intermediate_size`` added ungated. Routers: V2 softmax, ``topk_method`` "greedy" (one
  group) or "group_limited_greedy" (``n_group`` groups scored by their best expert,
  ``topk_group`` kept), never renormalised (transformers' V2 router does not read
  ``norm_topk_prob``); V3 sigmoid + ``e_score_correction_bias`` (``mlp.gate.e_score_correction_bias``)
  with grouped top-k (noaux_tc), renormalised with ``norm_topk_prob``. Weights x
  ``routed_scaling_factor``.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import ReplicatedLinear
from pagedllm.model_executor.layers.mla import MultiHeadLatentAttention, mla_softmax_scale
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.rotary_embedding import get_rope, get_rope_parameters
from pagedllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from pagedllm.model_executor.models.llama import LLAMA_NORMS, DecoderLayer, LlamaMLP, LlamaModel, PPMissingLayer
from pagedllm.model_executor.models.llama_moe import LlamaMoEForCausalLM
from pagedllm.model_executor.utils import default_weight_loader


def is_moe_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` holds experts (module docstring)."""
    freq = getattr(config, "moe_layer_freq", None) or 1
    return bool(config.n_routed_experts) and layer_idx >= config.first_k_dense_replace and layer_idx % freq == 0


class DeepseekMoE(nn.Module):
    """x [T, H] -> [T, H]: routed experts (``FusedMoE``, all-reduced over the tensor-parallel
    ranks) plus the shared experts. ``gate`` is the router [E, H]; V3's carries
    ``e_score_correction_bias`` [E] (float32)."""

    def __init__(self, config: PretrainedConfig, sigmoid_router: bool, quant_config: Optional[QuantizationConfig],
                 prefix: str) -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate")
        bias = None
        if sigmoid_router:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                             requires_grad=False)
            bias = self.gate.e_score_correction_bias
            groups, kept, scoring, renormalize = config.n_group, config.topk_group, "sigmoid", bool(config.norm_topk_prob)
        elif config.topk_method == "group_limited_greedy":
            groups, kept, scoring, renormalize = config.n_group, config.topk_group, "softmax", False
        elif config.topk_method == "greedy":
            groups, kept, scoring, renormalize = 1, 1, "softmax", False
        else:
            raise ValueError(f"topk_method {config.topk_method!r} is not built (built: 'greedy', 'group_limited_greedy').")
        self.experts = FusedMoE(
            num_experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size,
            reduce_results=True, renormalize=renormalize, use_grouped_topk=True, num_expert_group=groups,
            topk_group=kept, quant_config=quant_config, prefix=f"{prefix}.experts", scoring_func=scoring,
            routed_scaling_factor=config.routed_scaling_factor, e_score_correction_bias=bias,
            activation=config.hidden_act,
        )
        self.shared_experts: Optional[LlamaMLP] = None
        if config.n_shared_experts:
            self.shared_experts = LlamaMLP(config, quant_config, f"{prefix}.shared_experts",
                                           intermediate_size=config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekModel(LlamaModel):
    """``LlamaModel``'s stage of the decoder stack (and its ``forward``) with DeepSeek layers:
    MLA, then a dense MLP or ``DeepseekMoE``, in Llama's pre-norm residual block; one rope of
    ``qk_rope_head_dim`` channels."""

    def __init__(self, config: PretrainedConfig, is_neox_style: bool, sigmoid_router: bool,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        self.is_neox_style, self.sigmoid_router = is_neox_style, sigmoid_router
        self.softmax_scale = mla_softmax_scale(config, get_rope_parameters(config))
        super().__init__(config, False, False, quant_config, prefix)

    def rotary_embeddings(self, config: PretrainedConfig) -> tuple[list[nn.Module], list[int]]:
        rope_dim = config.qk_rope_head_dim
        table = get_rope(rope_dim, rope_dim, config.max_position_embeddings, get_rope_parameters(config),
                         self.is_neox_style)
        return [table], [0] * config.num_hidden_layers

    def make_layer(self, config: PretrainedConfig, layer_idx: int, rotary_emb: nn.Module, sliding_window: Optional[int],
                   quant_config: Optional[QuantizationConfig], prefix: str) -> nn.Module:
        attn = MultiHeadLatentAttention(config, rotary_emb, self.softmax_scale, quant_config, f"{prefix}.self_attn")
        if is_moe_layer(config, layer_idx):
            mlp: nn.Module = DeepseekMoE(config, self.sigmoid_router, quant_config, f"{prefix}.mlp")
        else:
            mlp = LlamaMLP(config, quant_config, f"{prefix}.mlp")
        return DecoderLayer(attn, mlp, LLAMA_NORMS, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))


class DeepseekV2ForCausalLM(LlamaMoEForCausalLM):
    """DeepSeek-V2 (module docstring); ``forward`` / ``compute_logits`` as ``LlamaForCausalLM``'s.
    Class attribute ``sigmoid_router``: V3's router."""

    sigmoid_router = False

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = DeepseekModel(config, self.rope_is_neox_style(config), self.sigmoid_router, quant_config, "model")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head: nn.Module = PPMissingLayer()
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
            if self.tie_word_embeddings:
                self.lm_head.tie_weights(self.model.embed_tokens)

    @staticmethod
    def rope_is_neox_style(config: PretrainedConfig) -> bool:
        """V2 rotates interleaved pairs."""
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the attention tensors (transformers' names, one parameter each) directly and
        the others as ``LlamaMoEForCausalLM.load_weights`` does, skipping the layers past
        ``num_hidden_layers`` (V3's multi-token-prediction layers); returns the names loaded.

        Raises:
            ValueError: as ``LlamaMoEForCausalLM.load_weights``.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def others() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if _layer_index(name) >= self.config.num_hidden_layers:
                    continue
                param = params.get(name) if ".self_attn." in name else None
                if param is None:
                    yield name, tensor
                    continue
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)

        return super().load_weights(others()) | loaded


def _layer_index(name: str) -> int:
    """The decoder layer of a ``model.layers.<i>.`` tensor name; -1 for the others."""
    parts = name.split(".", 3)
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    sigmoid_router = True

    @staticmethod
    def rope_is_neox_style(config: PretrainedConfig) -> bool:
        """Interleaved pairs with ``rope_interleave`` (the default), else the halves."""
        return not getattr(config, "rope_interleave", True)
