"""gpt-oss (transformers' ``GptOssForCausalLM``): a Llama-style decoder with q/k/v/o biases,
a learned attention sink per query head (``self_attn.sinks``, a logit in every softmax's
denominator), ``sliding_window`` on the "sliding_attention" ``layer_types`` (alternating with
full attention), YaRN rope, and a mixture of experts on every layer: a router with a bias
(``mlp.router``; softmax over the ``num_experts_per_tok`` largest logits) over
``num_local_experts`` experts with biases and the clamped SwiGLU (``swiglu_alpha``,
``swiglu_limit``).

Expert tensors as transformers writes them: ``mlp.experts.gate_up_proj`` [E, H, 2 x I] (x @ W,
gate and up columns interleaved: gate 2j, up 2j + 1), ``gate_up_proj_bias`` [E, 2 x I] (the
same interleaving), ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]; the published
checkpoints hold ``gate_up_proj`` / ``down_proj`` as MXFP4 ``_blocks`` / ``_scales`` of the
transposed matrices [E, 2 x I, H] / [E, H, I], dequantized at load (``quantization.mxfp4``).
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.fused_moe.router import topk_softmax
from pagedllm.model_executor.layers.linear import ReplicatedLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.quantization.mxfp4 import dequantize_mxfp4_weights
from pagedllm.model_executor.models.llama import LLAMA_NORMS, DecoderLayer, LlamaAttention, LlamaModel
from pagedllm.model_executor.models.llama_moe import LlamaMoEForCausalLM

#: Checkpoint tensor of a layer's experts -> (FusedMoE parameter, matrix: [E, in, out] as x @ W).
_EXPERT_TENSORS = {
    "gate_up_proj": ("w13_weight", True),
    "gate_up_proj_bias": ("w13_bias", False),
    "down_proj": ("w2_weight", True),
    "down_proj_bias": ("w2_bias", False),
}


class GptOssMoE(nn.Module):
    """x [T, H] -> [T, H]: ``router`` (replicated, with a bias) scores the experts, ``experts``
    (``FusedMoE``: biases, "swigluoai") sums the ``num_experts_per_tok`` chosen experts'
    outputs weighted by the softmax over their router logits."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True, prefix=f"{prefix}.router")
        self.experts = FusedMoE(
            config.num_local_experts, config.num_experts_per_tok, config.hidden_size, config.intermediate_size,
            reduce_results=True, quant_config=quant_config, prefix=f"{prefix}.experts",
            custom_routing_function=topk_softmax, activation="swigluoai", has_bias=True,
            swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


def make_gpt_oss_moe(config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                     prefix: str) -> nn.Module:
    """Every layer's feed-forward block: the experts (``llama.MakeMLP``)."""
    return GptOssMoE(config, quant_config, prefix)


class GptOssModel(LlamaModel):
    """``LlamaModel`` whose attention layers have gpt-oss's learned sinks (``LlamaAttention(sinks=True)``)."""

    def make_layer(self, config, layer_idx, rotary_emb, sliding_window, quant_config, prefix):
        attn = LlamaAttention(
            config, self.qkv_bias, self.qk_norm, rotary_emb, quant_config, f"{prefix}.self_attn", sliding_window,
            sinks=True,
        )
        mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        return DecoderLayer(attn, mlp, LLAMA_NORMS, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))


class GptOssForCausalLM(LlamaMoEForCausalLM):
    """``LlamaForCausalLM`` with gpt-oss's attention sinks, biases and experts (module
    docstring); ``attention_bias`` (true in gpt-oss's configs) gives q/k/v/o their biases."""

    model_cls = GptOssModel
    make_mlp = staticmethod(make_gpt_oss_moe)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``LlamaMoEForCausalLM.load_weights`` with MXFP4 expert tensors dequantized to the
        experts' dtype first (``dequantize_mxfp4_weights``).

        Raises:
            ValueError: as the parent's; an MXFP4 tensor without its other half.
        """
        moe = next((m for m in self.modules() if isinstance(m, FusedMoE)), None)
        dtype = moe.w13_weight.dtype if moe is not None else torch.get_default_dtype()
        # The experts' matrices dequantize as [E, out, in]: transposed to the dense checkpoints' [E, in, out].
        matrices = (".experts.gate_up_proj", ".experts.down_proj")
        return super().load_weights(dequantize_mxfp4_weights(weights, dtype, transpose_suffixes=matrices))

    def _load_expert(self, layer: FusedMoE, match: re.Match, name: str, tensor: torch.Tensor) -> str:
        """Load one stacked expert tensor (``_EXPERT_TENSORS``) into ``layer``: matrices
        transposed to [E, out, in], gate / up columns de-interleaved into [gate | up]."""
        proj = match["proj"]
        if "expert" in match.groupdict() or proj not in _EXPERT_TENSORS:
            raise ValueError(
                f"Checkpoint tensor {name!r} has no matching parameter (gpt-oss expert tensors: "
                f"{', '.join(_EXPERT_TENSORS)})."
            )
        param_name, is_matrix = _EXPERT_TENSORS[proj]
        expected_dim = 3 if is_matrix else 2
        if tensor.dim() != expected_dim or tensor.shape[0] != layer.global_num_experts:
            raise ValueError(
                f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; expected {expected_dim} dimensions, "
                f"the first of {layer.global_num_experts} experts."
            )
        if is_matrix:
            tensor = tensor.transpose(1, 2)  # [E, out, in]
        param = getattr(layer, param_name)
        for expert_id, part in enumerate(tensor):
            if proj.startswith("down_proj"):
                layer.weight_loader(param, part, name, "w2", expert_id)
            else:
                layer.weight_loader(param, part[0::2], name, "w1", expert_id)
                layer.weight_loader(param, part[1::2], name, "w3", expert_id)
        return f"{match['layer']}.{param_name}"

