"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434), as transformers'
``DeepseekV2Attention`` / ``DeepseekV3Attention`` compute it, over a paged cache of latents.

Per token (H heads; this rank's with tensor parallelism):

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))    (q_lora_rank set; else q_proj(x))
             -> [H, qk_nope_head_dim | qk_rope_head_dim]
    latent = kv_a_proj_with_mqa(x) -> kv_c [kv_lora_rank] | k_pe [qk_rope_head_dim]
    kv_c   = kv_a_layernorm(kv_c); q_pe, k_pe rotated (k_pe one head shared by all)
    k_h    = [W_UK_h kv_c | k_pe], v_h = W_UV_h kv_c    (kv_b_proj = [W_UK; W_UV] per head)
    out    = o_proj(softmax(scale q_h . k_h) v_h)

``MLAAttention`` is the paged part: its cache holds [kv_c | k_pe] per token (one head of
kv_lora_rank + qk_rope_head_dim values), computed by an MLA backend
(``pagedllm.attention.backends.torch_mla``: decompression for prefills, weight absorption
for decodes). ``MultiHeadLatentAttention`` is the layer a model holds: projections, norms,
rope, and ``MLAAttention``.

Softmax scale: ``qk_head_dim ** -0.5``, times ``mscale ** 2`` with ``mscale = 0.1 x
mscale_all_dim x ln(factor) + 1`` when the rope is scaled (not "default") and sets
``mscale_all_dim`` (transformers' ``yarn_apply_mscale``); yarn's own ``attention_factor``
scales the rotated channels through the rope's cos / sin.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.metadata import get_forward_context
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding

#: The epsilon of ``q_a_layernorm`` / ``kv_a_layernorm`` (transformers' RMSNorm default; not ``rms_norm_eps``).
_LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(config: PretrainedConfig, rope_parameters: dict) -> float:
    """``qk_head_dim ** -0.5`` with the YaRN ``mscale_all_dim`` correction (module docstring)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    mscale_all_dim = rope_parameters.get("mscale_all_dim") or 0
    factor = rope_parameters.get("factor") or 1.0
    if rope_parameters.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAAttention(Attention):
    """Paged MLA over a latent cache (one "head" of ``kv_lora_rank + qk_rope_head_dim`` per
    token: ``num_kv_heads`` 1, ``head_dim`` that width, so the runner binds and sizes its
    cache as any ``Attention``'s), on the MLA backend the model is built with.

    Args:
        num_heads: this rank's query heads; scale: the softmax scale.
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: the config's.
        kv_b_proj: the layer's up-projection ([H * (qk_nope_head_dim + v_head_dim),
            kv_lora_rank], this rank's heads), read by the backend.

    Raises:
        ValueError: the backend the model is built with is not an MLA one.
    """

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_b_proj: nn.Module) -> None:
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, 1, scale)
        if not self.attn_backend.is_mla():
            raise ValueError(f"Attention backend {self.attn_backend.get_name()} has no multi-head latent attention.")
        self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim = kv_lora_rank, qk_nope_head_dim, v_head_dim
        # NOTE: a plain attribute, not a submodule: the enclosing layer owns (and loads) it.
        object.__setattr__(self, "kv_b_proj", kv_b_proj)
        self._absorbed: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """q [T, H, qk_nope_head_dim + qk_rope_head_dim] (rope part rotated), kv_c [T,
        kv_lora_rank] (normalised), k_pe [T, qk_rope_head_dim] (rotated) -> [T, H * v_head_dim]."""
        out = self.impl.forward(self, q, kv_c, k_pe, self.kv_cache, get_forward_context(self.kv_cache_group_id))
        return out.reshape(q.shape[0], -1)

    def absorbed_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, qk_nope_head_dim, kv_lora_rank], W_UV [H, v_head_dim, kv_lora_rank]) in
        ``dtype``: ``kv_b_proj``'s matrix, read once (after loading) by applying the layer to
        the identity, so a quantized ``kv_b_proj`` gives its dequantized weights."""
        if self._absorbed is None or self._absorbed[0].dtype != dtype:
            eye = torch.eye(self.kv_lora_rank, dtype=dtype, device=self.k_scale.device)
            weight = self.kv_b_proj(eye).t().reshape(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
            nope = self.qk_nope_head_dim
            self._absorbed = (weight[:, :nope].contiguous(), weight[:, nope:].contiguous())
        return self._absorbed


class MultiHeadLatentAttention(nn.Module):
    """A decoder layer's MLA (module docstring): ``forward(rope, x [T, hidden]) -> [T, hidden]``
    with ``rope`` the model's ``rotary_emb.cos_sin(positions)``. Checkpoint names as
    transformers': ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` (``attention_bias``
    on q_a_proj, kv_a_proj_with_mqa and o_proj).

    Args:
        config: a DeepSeek-V2 / V3 config (``q_lora_rank`` None: a plain ``q_proj``).
        rotary_emb: the rope of the ``qk_rope_head_dim`` channels (its layout is the model's).
        scale: the softmax scale (``mla_softmax_scale``).
    """

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, scale: float,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        linear = dict(quant_config=quant_config)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * self.qk_head_dim, bias=False,
                                               prefix=f"{prefix}.q_proj", **linear)
            self.num_heads = self.q_proj.output_size_per_partition // self.qk_head_dim
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, prefix=f"{prefix}.q_a_proj", **linear)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * self.qk_head_dim, bias=False,
                                                 prefix=f"{prefix}.q_b_proj", **linear)
            self.num_heads = self.q_b_proj.output_size_per_partition // self.qk_head_dim
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias,
                                                   prefix=f"{prefix}.kv_a_proj_with_mqa", **linear)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + config.v_head_dim),
                                              bias=False, prefix=f"{prefix}.kv_b_proj", **linear)
        self.o_proj = RowParallelLinear(total_heads * config.v_head_dim, hidden, bias=bias, prefix=f"{prefix}.o_proj",
                                        **linear)
        self.rotary_emb = rotary_emb
        self.mla_attn = MLAAttention(self.num_heads, scale, self.kv_lora_rank, self.qk_nope_head_dim,
                                     self.qk_rope_head_dim, config.v_head_dim, self.kv_b_proj)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.rotary_emb(q[..., self.qk_nope_head_dim :].contiguous(), k_pe.unsqueeze(1).contiguous(), *rope)
        q = torch.cat((q[..., : self.qk_nope_head_dim], q_pe), dim=-1)
        return self.o_proj(self.mla_attn(q, kv_c, k_pe.squeeze(1)))
