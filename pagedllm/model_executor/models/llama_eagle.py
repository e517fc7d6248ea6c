"""EAGLE and EAGLE-3 draft heads for Llama-family targets, in the checkpoint layouts of the
EAGLE authors (SafeAILab/EAGLE) that vLLM loads.

A head is one decoder layer that reads the target's hidden states; it has no embeddings of
its own (EAGLE trains with the target's, frozen: ``bind_target`` shares them), and predicts
the token after next from the next token and the target's feature at the current position.
Both classes take ``forward(input_ids [T], positions [T], hidden_states [T, hidden]) ->
(for_logits [T, hidden], for_next_step [T, hidden])`` and ``compute_logits``.

EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"; vLLM's ``EagleLlamaForCausalLM``; config.json a Llama one with
``num_hidden_layers`` 1, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B)::

    fc.weight [hidden, 2 x hidden] (+ fc.bias when config.json's "bias" is true)
    layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, post_attention_layernorm}
    (layers.0.input_layernorm and embed_tokens may be present: not used)

    x = fc([embed(token) ; target hidden]) -> decoder layer without its input norm
    -> x + residual: the next feature, scored by the target's lm_head

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test"; vLLM's ``Eagle3LlamaForCausalLM``, config.json
``LlamaForCausalLMEagle3``, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)::

    fc.weight [hidden, 3 x hidden]           low / mid / high target layers -> hidden
    midlayer.self_attn.{q,k,v}_proj [.., 2 x hidden], o_proj; midlayer.mlp.*
    midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}, norm
    lm_head.weight [draft_vocab_size, hidden]
    d2t [draft_vocab_size] int64: target id = draft id + d2t[draft id]   (t2d: not used)

    g = fc(target features) once; each step: attention over
    [input_layernorm(embed(token)) ; hidden_norm(g)], residual g -> mlp -> norm
    -> lm_head over the draft vocabulary; the pre-norm sum is the next step's g
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pagedllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from pagedllm.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    load_llama_weights,
)


def _rotary_embedding(config: PretrainedConfig) -> RotaryEmbedding:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return get_rope(head_dim, head_dim, config.max_position_embeddings, get_rope_parameters(config))


class _EagleHead(nn.Module):
    """What both heads share: the target's embeddings (``bind_target``) and the
    checkpoint-name mapping of ``load_weights``.

    Class attributes: ``renamed`` (checkpoint name prefix -> parameter name prefix) and
    ``unused`` (checkpoint tensors the head does not use).
    """

    renamed: dict[str, str] = {}
    unused: tuple[str, ...] = ("embed_tokens.weight",)

    def bind_target(self, target: LlamaForCausalLM) -> None:
        """Use ``target``'s token embeddings (EAGLE trains with them, frozen)."""
        self.embed_tokens = target.model.embed_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the head's checkpoint tensors into its parameters (a leading ``model.`` is
        dropped); returns the names loaded.

        Raises:
            ValueError: a tensor with no matching parameter, or a shape mismatch.
        """

        def renamed(name: str) -> str:
            name = name.removeprefix("model.")
            for old, new in self.renamed.items():
                if name.startswith(old):
                    return new + name[len(old):]
            return name

        return load_llama_weights(self, ((renamed(n), t) for n, t in weights if n.removeprefix("model.") not in self.unused))


class EagleLlamaForCausalLM(_EagleHead):
    """EAGLE-1 head (see the module docstring); logits from the target's lm_head
    (``bind_target``), over the target's vocabulary (``draft_id_to_target_id`` None).

    Args:
        config: the head's config.json (``bias``: whether ``fc`` has a bias, EAGLE's key).
        quant_config: the head's quantization (None: unquantized).
    """

    unused = ("embed_tokens.weight", "layers.0.input_layernorm.weight")

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=bool(getattr(config, "bias", False)),
                                   quant_config=quant_config, prefix="fc")
        self.rotary_emb = _rotary_embedding(config)
        qkv_bias = bool(getattr(config, "attention_bias", False))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, False, self.rotary_emb, quant_config, f"layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        # EAGLE's first layer has no input norm (its input is fc's output).
        self.layers[0].input_layernorm = nn.Identity()
        self.draft_id_to_target_id: Optional[torch.Tensor] = None

    def bind_target(self, target: LlamaForCausalLM) -> None:
        """Use ``target``'s embeddings and lm_head."""
        super().bind_target(target)
        self.lm_head = target.lm_head

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's features as the head reads them: its last hidden state [T, hidden], as is."""
        return hidden_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ``input_ids`` [T] at ``positions`` [T] with the feature ``hidden_states``
        [T, hidden] of the position before -> the predicted next feature [T, hidden],
        twice (EAGLE-1 scores and feeds back the same tensor)."""
        embeds = self.embed_tokens(input_ids)
        hidden_states = self.fc(torch.cat((embeds, hidden_states), dim=-1))
        rope = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(rope, hidden_states, residual)
        hidden_states = hidden_states + residual
        return hidden_states, hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits, by the target's lm_head."""
        return self.lm_head.compute_logits(hidden_states)


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's ``midlayer``: attention over [input_layernorm(embeds) ; hidden_norm(hidden)]
    (q/k/v of 2 x hidden inputs), then the MLP; ``norm_before_residual`` (config.json)
    makes the residual the normed hidden state rather than the raw one."""

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding,
                 quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        qkv_bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, qkv_bias, False, rotary_emb, quant_config, f"{prefix}.self_attn")
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(
            2 * hidden, attn.head_dim, attn.qkv_proj.total_num_heads, attn.qkv_proj.total_num_kv_heads,
            bias=qkv_bias, quant_config=quant_config, prefix=f"{prefix}.self_attn.qkv_proj",
        )
        self.mlp = LlamaMLP(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], embeds: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden_states [T, hidden] -> (MLP output, residual) [T, hidden] each."""
        normed = self.hidden_norm(hidden_states)
        residual = normed if self.norm_before_residual else hidden_states
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        x, residual = self.post_attention_layernorm(self.self_attn(rope, x), residual)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(_EagleHead):
    """EAGLE-3 head (see the module docstring): its own lm_head over ``draft_vocab_size``
    tokens (config.json; absent: the target's vocabulary), mapped to target ids by
    ``draft_id_to_target_id`` (the checkpoint's ``d2t``).

    Args:
        config: the head's config.json.
        quant_config: the head's quantization (None: unquantized).

    Raises:
        ValueError: a head of more than one decoder layer (EAGLE-3 checkpoints have one).
    """

    renamed = {"d2t": "draft_id_to_target_id"}
    unused = ("embed_tokens.weight", "t2d")

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(f"An EAGLE-3 head has one decoder layer (midlayer); config.json has "
                             f"num_hidden_layers {config.num_hidden_layers}.")
        self.config = config
        hidden = config.hidden_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.fc = ReplicatedLinear(3 * hidden, hidden, bias=False, quant_config=quant_config, prefix="fc")
        self.rotary_emb = _rotary_embedding(config)
        self.midlayer = Eagle3DecoderLayer(config, self.rotary_emb, quant_config, "midlayer")
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden, quant_config=quant_config, prefix="lm_head")
        self.draft_id_to_target_id = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64),
                                                  requires_grad=False)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's low / mid / high layer inputs, concatenated [T, 3 x hidden] -> [T, hidden]."""
        return self.fc(hidden_states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ``input_ids`` [T] at ``positions`` [T] with the feature ``hidden_states``
        [T, hidden] of the position before (``combine_hidden_states``' output, or this
        head's own second output) -> (normed [T, hidden] for ``compute_logits``, pre-norm
        [T, hidden] for the next step)."""
        embeds = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, embeds.dtype)
        hidden_states, residual = self.midlayer(rope, embeds, hidden_states)
        return self.norm(hidden_states, residual)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, draft_vocab_size] logits; index i is target token
        i + draft_id_to_target_id[i]."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As ``_EagleHead.load_weights``; a head whose draft vocabulary is the target's may
        leave out ``d2t`` (the identity).

        Raises:
            ValueError: a tensor with no matching parameter, or a shape mismatch.
        """
        loaded = super().load_weights(weights)
        if self.draft_vocab_size == self.config.vocab_size:
            loaded.add("draft_id_to_target_id")
        return loaded
