"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Architecture as in the HF transformers implementations of the same names; our own code,
with fused q/k/v and gate/up projections and attention over the paged KV cache.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.activation import SiluAndMul
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import (
    FusedLinear,
    Linear,
    QKVLinear,
    can_pack,
    default_weight_loader,
    linear,
    pack_w16,
    pack_weight,
    should_widen,
)
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, apply_rotary, get_rope_parameters

#: Bytes of one [rows, 2 x intermediate] chunk of the MLP on CPU (see ``LlamaMLP.forward``).
_CPU_MLP_CHUNK_BYTES = 16 << 20


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        self.qkv_proj = QKVLinear(hidden, self.head_dim, self.num_heads, self.num_kv_heads, bias=qkv_bias)
        # ``attention_bias`` (Llama, Qwen3) puts a bias on q, k, v and o; Qwen2 has q/k/v bias only.
        o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        num_tokens = hidden_states.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.contiguous())
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = FusedLinear(config.hidden_size, [config.intermediate_size] * 2, (0, 1), bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. On CPU, long inputs go through in row chunks
        (``_CPU_MLP_CHUNK_BYTES`` of [gate | up] each): glibc serves allocations over 32 MiB
        with fresh pages every time, and the page faults of an 80 MB [4096, 2 x 4864] bf16
        intermediate cost more than the matmuls gain from the extra rows."""
        num_tokens = x.shape[0]
        chunk = self._cpu_chunk_rows(x)
        if chunk >= num_tokens:
            return self.down_proj(self.act_fn(self.gate_up_proj(x)))
        out = torch.empty((num_tokens, self.down_proj.output_size), dtype=x.dtype, device=x.device)
        for start in range(0, num_tokens, chunk):
            rows = slice(start, min(start + chunk, num_tokens))
            out[rows] = self.down_proj(self.act_fn(self.gate_up_proj(x[rows])))
        return out

    def _cpu_chunk_rows(self, x: torch.Tensor) -> int:
        if x.device.type != "cpu":
            return x.shape[0]
        row_bytes = self.gate_up_proj.output_size * x.element_size()
        return max(64, _CPU_MLP_CHUNK_BYTES // row_bytes // 64 * 64)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rope, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope_theta, rope_scaling = get_rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_theta, rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(rope, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``
    and ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` (model dtype).

    Class attributes ``qkv_bias`` and ``qk_norm`` select the Qwen2 / Qwen3 variants.
    """

    qkv_bias = False
    qk_norm = False

    # checkpoint name part -> (fused parameter name part, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.qkv_bias or bool(getattr(config, "attention_bias", False)), self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        # The packed copy of tied embeddings (see process_weights_after_loading); a buffer,
        # so that the runner's weight-memory count includes it.
        self.register_buffer("_logits_weight", None, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def process_weights_after_loading(self) -> None:
        """Pack the output projection for the CPU matmul when possible: for oneDNN
        (``linear.pack_weight``), else a 16-bit one for ``linear_w16`` (``linear.pack_w16``).
        Tied embeddings get a packed copy (the lookup needs the plain rows): vocab x hidden
        more bytes, 272 MB for Qwen2.5-0.5B in bf16."""
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head
        if self._logits_weight is not None or weight.is_mkldnn or weight.dim() == 3:
            return
        if can_pack(weight.data):
            packed = pack_weight(weight.data)
        elif should_widen(weight.data):
            packed = pack_w16(weight.data)
        else:
            return
        if self.tie_word_embeddings:
            self._logits_weight = packed
        else:
            self.lm_head = nn.Parameter(packed, requires_grad=False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model dtype (the sampler upcasts once)."""
        if self._logits_weight is not None:
            weight = self._logits_weight
        else:
            weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head
        return linear(hidden_states, weight, out_features=self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns the names loaded.

        Raises:
            ValueError: for a checkpoint tensor with no matching parameter, or a shape mismatch.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight":
                if self.tie_word_embeddings:
                    continue
                name = "lm_head"
            shard_id = None
            for ckpt_part, (fused_part, sid) in self.packed_modules_mapping.items():
                if f".{ckpt_part}." in name:
                    name, shard_id = name.replace(f".{ckpt_part}.", f".{fused_part}."), sid
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}.")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                default_weight_loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(name)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
