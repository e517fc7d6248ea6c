"""TII Falcon-H1 (``FalconH1ForCausalLM``): Llama's pre-norm decoder whose every layer runs
attention (rope on every channel) and a Mamba-2 mixer side by side on the same normed input,
adds their outputs, then a SwiGLU MLP, as transformers' ``modeling_falcon_h1`` (our own code
on the shared blocks). Each layer keeps its attention's KV in the paged cache and its mixer's
state in the state cache (``arch_config.HYBRID_LAYER_TYPE``).

The mixer is ``MambaMixer2`` of ``mamba_d_ssm`` channels (None: ``mamba_expand x hidden``)
with its gated RMSNorm optional (``mamba_rms_norm``; gate before or after the norm by
``mamba_norm_before_gate``) and ``projectors_bias`` on ``out_proj``. Falcon-H1's µP factors
apply where transformers applies them, at forward time (a factor of 1 costs nothing):
``embedding_multiplier`` on the embeddings, ``ssm_in_multiplier`` / ``attention_in_multiplier``
on each block's input, ``ssm_multipliers`` on the z / x / B / C / dt parts of ``in_proj``'s
output, ``ssm_out_multiplier`` / ``attention_out_multiplier`` on each block's output,
``mlp_multipliers`` on the gate projection and the MLP's output, ``lm_head_multiplier`` on the
logits; ``key_multiplier`` on the keys, which (rope being linear) is the attention's softmax
scale times it.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.activation import SiluAndMul
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2, mamba2_state_shape
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.bamba import BambaForCausalLM
from pagedllm.model_executor.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel


def mamba_intermediate_size(config: PretrainedConfig) -> int:
    """The mixer's channels: ``mamba_d_ssm``, or ``mamba_expand x hidden_size`` when it is None."""
    if config.mamba_d_ssm is not None:
        return int(config.mamba_d_ssm)
    return int(config.mamba_expand * config.hidden_size)


def in_proj_multipliers(config: PretrainedConfig) -> Optional[torch.Tensor]:
    """The [2 I + 2 G N + H] float32 factors on ``in_proj``'s output (transformers'
    ``compute_mup_vector``): ``ssm_multipliers`` [z, x, B, C, dt] each over its part (z and x
    of I channels, B and C of ``mamba_n_groups x mamba_d_state``, dt of ``mamba_n_heads``);
    None when every factor is 1.

    Raises:
        ValueError: ``ssm_multipliers`` not of 5 factors.
    """
    factors = [float(f) for f in config.ssm_multipliers]
    if len(factors) != 5:
        raise ValueError(f"ssm_multipliers needs 5 factors (z, x, B, C, dt), got {config.ssm_multipliers!r}.")
    if all(f == 1.0 for f in factors):
        return None
    intermediate, groups = mamba_intermediate_size(config), config.mamba_n_groups * config.mamba_d_state
    sizes = (intermediate, intermediate, groups, groups, config.mamba_n_heads)
    return torch.cat([torch.full((n,), f, dtype=torch.float32) for n, f in zip(sizes, factors)])


class FalconH1Mixer(MambaMixer2):
    """``MambaMixer2`` of Falcon-H1's config keys (``mamba_*``, ``projectors_bias``,
    ``ssm_multipliers``); ``forward(hidden_states [T, hidden]) -> [T, hidden]``."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__(
            config.hidden_size, mamba_intermediate_size(config), config.mamba_n_heads, config.mamba_d_head,
            config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv, config.mamba_chunk_size,
            config.mamba_conv_bias, config.mamba_proj_bias, config.rms_norm_eps, config.time_step_limit,
            quant_config, prefix, out_proj_bias=bool(config.projectors_bias), rms_norm=bool(config.mamba_rms_norm),
            norm_before_gate=bool(config.mamba_norm_before_gate), in_proj_scale=in_proj_multipliers(config),
        )


class ScaledGateSiluAndMul(nn.Module):
    """[T, 2d] -> [T, d]: silu(m x gate) x up (Falcon-H1's gate ``mlp_multipliers[0]`` m); the
    gate half is scaled in place (the input is ``gate_up_proj``'s fresh output)."""

    def __init__(self, multiplier: float) -> None:
        super().__init__()
        self.multiplier = multiplier
        self.silu_and_mul = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[..., : x.shape[-1] // 2].mul_(self.multiplier)
        return self.silu_and_mul(x)


def _scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    """x x multiplier as a new tensor (x itself when the multiplier is 1)."""
    return x if multiplier == 1.0 else x * multiplier


def _scaled_(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    """x x multiplier in place (x is a block's fresh output)."""
    return x if multiplier == 1.0 else x.mul_(multiplier)


class FalconH1DecoderLayer(nn.Module):
    """One Falcon-H1 layer on the residual stream h (transformers' ``FalconH1DecoderLayer``)::

        x = input_layernorm(h)
        h = h + ssm_out x mamba(ssm_in x x) + attn_out x self_attn(attn_in x x)
        h = h + mlp_down x feed_forward(pre_ff_layernorm(h))

    The stream travels as ``(hidden_states, residual)``, as ``llama.DecoderLayer``'s.

    Raises:
        ValueError: ``mlp_multipliers`` not of 2 factors, ``ssm_multipliers`` not of 5.
    """

    def __init__(self, config: PretrainedConfig, rotary_emb: nn.Module, quant_config: Optional[QuantizationConfig],
                 prefix: str) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.mamba = FalconH1Mixer(config, quant_config, f"{prefix}.mamba")
        self.self_attn = LlamaAttention(
            config, bool(config.attention_bias), False, rotary_emb, quant_config, f"{prefix}.self_attn",
            scale=head_dim**-0.5 * float(config.key_multiplier))
        if len(config.mlp_multipliers) != 2:
            raise ValueError(f"mlp_multipliers needs 2 factors (gate, down), got {config.mlp_multipliers!r}.")
        gate_multiplier, self.mlp_multiplier = (float(m) for m in config.mlp_multipliers)
        act_fn = None if gate_multiplier == 1.0 else ScaledGateSiluAndMul(gate_multiplier)
        self.feed_forward = LlamaMLP(config, quant_config, f"{prefix}.feed_forward", act_fn=act_fn)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ssm_in, self.ssm_out = float(config.ssm_in_multiplier), float(config.ssm_out_multiplier)
        self.attn_in, self.attn_out = float(config.attention_in_multiplier), float(config.attention_out_multiplier)

    def forward(self, rope, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]):
        """(hidden_states, residual) [T, hidden] each (residual None at the first layer) -> the
        same pair after this layer."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        mixed = _scaled_(self.mamba(_scaled(hidden_states, self.ssm_in)), self.ssm_out)
        attended = _scaled_(self.self_attn(rope, _scaled(hidden_states, self.attn_in)), self.attn_out)
        hidden_states, residual = self.pre_ff_layernorm(mixed.add_(attended), residual)
        return _scaled_(self.feed_forward(hidden_states), self.mlp_multiplier), residual


class FalconH1Model(LlamaModel):
    def embedding_scale(self, config: PretrainedConfig) -> Optional[float]:
        multiplier = float(config.embedding_multiplier)
        return None if multiplier == 1.0 else multiplier

    def make_layer(self, config, layer_idx, rotary_emb, sliding_window, quant_config, prefix):
        return FalconH1DecoderLayer(config, rotary_emb, quant_config, prefix)


class FalconH1ForCausalLM(LlamaForCausalLM):
    """Falcon-H1 (``LlamaForCausalLM``'s interface; ``compute_logits`` multiplies by
    ``lm_head_multiplier``; the checkpoint's ``model.final_layernorm`` is ``model.norm``).
    ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` (vLLM's
    names): each layer's mixer state."""

    model_cls = FalconH1Model
    mamba_type = "mamba2"

    @classmethod
    def get_mamba_state_shape_from_config(cls, config: PretrainedConfig,
                                          tp_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """A mixer's (conv, ssm) state shapes per slot on each of ``tp_size`` ranks
        (``mamba2_state_shape``)."""
        return mamba2_state_shape(mamba_intermediate_size(config), config.mamba_n_groups, config.mamba_n_heads,
                                  config.mamba_d_head, config.mamba_d_state, config.mamba_d_conv, tp_size)

    get_mamba_state_dtype_from_config = BambaForCausalLM.get_mamba_state_dtype_from_config

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _scaled(super().compute_logits(hidden_states), float(self.config.lm_head_multiplier))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(
            (name.replace("model.final_layernorm.", "model.norm."), tensor) for name, tensor in weights)
