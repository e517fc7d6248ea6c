"""Llama 4's text model (transformers' ``Llama4ForCausalLM``, config ``Llama4TextConfig``).

A Llama decoder whose layers come in two kinds, by ``no_rope_layers`` (1: rope) and
``layer_types``:

- rope layers ("chunked_attention"): chunked local attention of ``attention_chunk_size`` C
  (a query at position i sees keys i - i % C .. i; their own KV-cache group, which frees the
  blocks of passed chunks), rope on interleaved channel pairs (transformers' complex
  product), then with ``use_qk_norm`` an L2 norm (no weight) over each query and key head;
- NoPE layers ("full_attention"): no rope, and with ``attn_temperature_tuning`` each query
  scaled by ``log1p(floor((position + 1) / floor_scale)) * attn_scale + 1``.

The feed-forward block is, on the ``moe_layers`` (from ``interleave_moe_layer_step``), a
router (``feed_forward.router``) picking the top-1 of ``num_local_experts`` experts by
sigmoid (``router.topk_sigmoid``), the token entering its expert scaled by that weight
(``FusedMoE(apply_router_weight_on_input=True)``), plus a shared expert (a SwiGLU MLP of
``intermediate_size``) on every token; elsewhere a SwiGLU MLP of ``intermediate_size_mlp``.

Checkpoint layout as transformers writes it: ``feed_forward.*`` (our ``mlp``), the experts
stacked as ``experts.gate_up_proj`` [E, H, 2 x I] (x @ W; gate columns, then up) and
``experts.down_proj`` [E, I, H]. An image-text checkpoint (``Llama4ForConditionalGeneration``,
the published ones) is served text-only: its ``text_config`` and ``language_model.*`` tensors.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.arch_config import layer_attention_chunk_sizes
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.fused_moe.router import topk_sigmoid
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import ReplicatedLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.rotary_embedding import get_rope, get_rope_parameters
from pagedllm.model_executor.models.llama import LLAMA_NORMS, DecoderLayer, LlamaAttention, LlamaMLP, LlamaModel
from pagedllm.model_executor.models.llama_moe import LlamaMoEForCausalLM

#: Tensor name prefixes of an image-text checkpoint's vision part (not loaded text-only).
_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] divided by its root mean square over D (no weight; computed in float32, back
    in x's dtype): transformers' ``Llama4TextL2Norm``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class AttentionTemperature(nn.Module):
    """The NoPE layers' query scales per position (transformers' ``attn_temperature_tuning``):
    ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` in float32.

    NOTE: it stands beside the rope table in ``LlamaModel.rotary_embeddings`` (computed once
    per forward from the positions, as the rope's cos / sin are), so ``cos_sin`` is its name.
    """

    def __init__(self, floor_scale: float, attn_scale: float) -> None:
        super().__init__()
        self.floor_scale, self.attn_scale = float(floor_scale), float(attn_scale)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor]:
        """(scales [T, 1, 1] float32,) for positions [T] (int64); ``dtype`` is not used."""
        del dtype
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (scales[:, None, None],)


class Llama4Attention(LlamaAttention):
    """``LlamaAttention`` of one Llama 4 layer (module docstring): with ``use_rope`` rope, then
    L2-normed query and key heads (``use_qk_norm``); else no rope and, with
    ``temperature_tuning``, the queries scaled by position. ``forward``'s ``rope`` is the
    layer's table output: (cos, sin) with rope, (scales,) without."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary_emb: nn.Module,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__(config, bool(config.attention_bias), False, rotary_emb, quant_config, prefix,
                         attention_chunk_size=layer_attention_chunk_sizes(config)[layer_idx])
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        self.l2_qk_norm = self.use_rope and bool(config.use_qk_norm)
        self.temperature_tuning = not self.use_rope and bool(config.attn_temperature_tuning)
        self.eps = config.rms_norm_eps

    def forward(self, rope: tuple[torch.Tensor, ...], hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        num_tokens = hidden_states.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = self.rotary_emb(q, k, *rope)
            if self.l2_qk_norm:
                q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        elif self.temperature_tuning:
            q = (q * rope[0]).to(q.dtype)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.contiguous())
        return self.o_proj(out)


class Llama4MoE(nn.Module):
    """x [T, H] -> [T, H]: ``router`` (replicated) picks one expert per token by sigmoid, the
    token enters it scaled by that weight (``experts``, all-reduced over the tensor-parallel
    ranks), and ``shared_expert`` (every token) adds its output."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.router = ReplicatedLinear(hidden, config.num_local_experts, bias=False, prefix=f"{prefix}.router")
        self.experts = FusedMoE(
            config.num_local_experts, config.num_experts_per_tok, hidden, config.intermediate_size,
            reduce_results=True, quant_config=quant_config, prefix=f"{prefix}.experts",
            custom_routing_function=topk_sigmoid, activation=config.hidden_act, apply_router_weight_on_input=True,
        )
        self.shared_expert = LlamaMLP(config, quant_config, f"{prefix}.shared_expert",
                                      intermediate_size=config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x) + self.experts(x, self.router(x))


def make_llama4_mlp(config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                    prefix: str) -> nn.Module:
    """``Llama4MoE`` on the ``moe_layers``, a dense MLP of ``intermediate_size_mlp`` elsewhere
    (``llama.MakeMLP``)."""
    if layer_idx in config.moe_layers:
        return Llama4MoE(config, quant_config, prefix)
    return LlamaMLP(config, quant_config, prefix, intermediate_size=config.intermediate_size_mlp)


class Llama4Model(LlamaModel):
    """``LlamaModel`` of Llama 4's layers: the rope table (interleaved pairs) for the rope
    layers, ``AttentionTemperature`` for the NoPE ones."""

    def rotary_embeddings(self, config: PretrainedConfig) -> tuple[list[nn.Module], list[int]]:
        head_dim = config.head_dim
        table = get_rope(head_dim, head_dim, config.max_position_embeddings, get_rope_parameters(config),
                         is_neox_style=False)
        temperature = AttentionTemperature(config.floor_scale, config.attn_scale)
        return [table, temperature], [0 if use_rope else 1 for use_rope in config.no_rope_layers]

    def make_layer(self, config, layer_idx, rotary_emb, sliding_window, quant_config, prefix):
        attn = Llama4Attention(config, layer_idx, rotary_emb, quant_config, f"{prefix}.self_attn")
        mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        return DecoderLayer(attn, mlp, LLAMA_NORMS, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))


class Llama4ForCausalLM(LlamaMoEForCausalLM):
    """Llama 4's text model (module docstring); ``forward`` / ``compute_logits`` as
    ``LlamaForCausalLM``'s."""

    model_cls = Llama4Model
    make_mlp = staticmethod(make_llama4_mlp)
    checkpoint_renames = ((".feed_forward.", ".mlp."),)

    def _load_expert(self, layer: FusedMoE, match: re.Match, name: str, tensor: torch.Tensor) -> str:
        """Load a stacked expert tensor, transformers' [E, in, out] (x @ W) transposed to the
        [E, out, in] ``FusedMoE.load_stacked_experts`` takes.

        Raises:
            ValueError: a per-expert tensor (Llama 4's are stacked), or as the parent's.
        """
        if "expert" in match.groupdict() or tensor.dim() != 3:
            raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter (Llama 4's experts are stacked: "
                             f"experts.gate_up_proj [E, H, 2 x I], experts.down_proj [E, I, H]).")
        return super()._load_expert(layer, match, name, tensor.transpose(1, 2))


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The language model of a Llama 4 image-text checkpoint, text-only: the config is its
    ``text_config`` (``pagedllm.arch_config.TEXT_ONLY_ARCHITECTURES``), the tensors its
    ``language_model.*`` ones; the vision tower's (``vision_model.*``) and the projector's
    (``multi_modal_projector.*``) are not loaded."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``Llama4ForCausalLM.load_weights`` of the ``language_model.`` tensors, that prefix
        removed; returns the names loaded.

        Raises:
            ValueError: as the parent's (a tensor of neither the language model nor the
                vision part has no matching parameter).
        """
        return super().load_weights(
            (name.removeprefix("language_model."), tensor) for name, tensor in weights
            if not name.startswith(_VISION_PREFIXES)
        )
