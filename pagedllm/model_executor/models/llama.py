"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Architecture as in the HF transformers implementations of the same names; our own code,
with fused q/k/v and gate/up projections (tensor-parallel layers: this rank's heads and
MLP columns) and attention over the paged KV cache.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.arch_config import layer_sliding_windows
from pagedllm.distributed import get_pp_group
from pagedllm.distributed.utils import pp_layer_range
from pagedllm.model_executor.layers.activation import SiluAndMul
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pagedllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_executor.kv_cache_scales import load_kv_cache_scale
from pagedllm.model_executor.utils import default_weight_loader
from pagedllm.platforms import current_platform

#: Bytes of one [rows, 2 x intermediate] chunk of the MLP on CPU (see ``LlamaMLP.forward``).
_CPU_MLP_CHUNK_BYTES = 16 << 20

# (fused parameter name part, checkpoint name part, shard id)
STACKED_PARAMS_MAPPING = [
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
]


class PPMissingLayer(nn.Identity):
    """Stands for a module held by another pipeline stage: no parameters, not loaded."""


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads: ``qkv_proj.num_heads`` query heads and
    ``qkv_proj.num_kv_heads`` KV heads (all of them at tensor-parallel size 1); with
    ``sliding_window`` W, a query at position i attends to keys i - W + 1 .. i only."""

    def __init__(
        self,
        config: PretrainedConfig,
        qkv_bias: bool,
        qk_norm: bool,
        rotary_emb: RotaryEmbedding,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
        sliding_window: Optional[int] = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_num_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_num_heads, total_num_kv_heads, bias=qkv_bias,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        # ``attention_bias`` (Llama, Qwen3) puts a bias on q, k, v and o; Qwen2 has q/k/v bias only.
        o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(
            total_num_heads * self.head_dim, hidden, bias=o_bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, sliding_window=sliding_window
        )

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        num_tokens = hidden_states.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(q, k, *rope)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.contiguous())
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """SwiGLU MLP; this rank's ``intermediate_size / tp_size`` columns (``intermediate_size``
    None: the config's; a mixture-of-experts model's shared expert passes its own)."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str,
                 intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [intermediate_size] * 2, bias=bias,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, config.hidden_size, bias=bias, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()
        #: Whether long inputs go through in row chunks (on CPU; see ``forward``).
        self.chunk_rows = current_platform.is_cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. On CPU, long inputs go through in row chunks
        (``_CPU_MLP_CHUNK_BYTES`` of [gate | up] each): glibc serves allocations over 32 MiB
        with fresh pages every time, and the page faults of an 80 MB [4096, 2 x 4864] bf16
        intermediate cost more than the matmuls gain from the extra rows."""
        num_tokens = x.shape[0]
        chunk = self._chunk_rows(x)
        if chunk >= num_tokens:
            return self.down_proj(self.act_fn(self.gate_up_proj(x)))
        out = torch.empty((num_tokens, self.down_proj.output_size), dtype=x.dtype, device=x.device)
        for start in range(0, num_tokens, chunk):
            rows = slice(start, min(start + chunk, num_tokens))
            out[rows] = self.down_proj(self.act_fn(self.gate_up_proj(x[rows])))
        return out

    def _chunk_rows(self, x: torch.Tensor) -> int:
        if not self.chunk_rows:
            return x.shape[0]
        row_bytes = self.gate_up_proj.output_size_per_partition * x.element_size()
        return max(64, _CPU_MLP_CHUNK_BYTES // row_bytes // 64 * 64)


#: ``make_mlp(config, layer_idx, quant_config, prefix) -> nn.Module``: a layer's feed-forward
#: block, ``forward(x [T, hidden]) -> [T, hidden]`` (a mixture-of-experts model returns its
#: expert block on its sparse layers).
MakeMLP = Callable[[PretrainedConfig, int, Optional[QuantizationConfig], str], nn.Module]


def make_llama_mlp(config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                   prefix: str) -> nn.Module:
    """The dense SwiGLU MLP on every layer (``MakeMLP``)."""
    return LlamaMLP(config, quant_config, prefix)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool, rotary_emb: RotaryEmbedding,
                 quant_config: Optional[QuantizationConfig], prefix: str, sliding_window: Optional[int] = None,
                 mlp: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config, qkv_bias, qk_norm, rotary_emb, quant_config, f"{prefix}.self_attn", sliding_window
        )
        self.mlp = mlp if mlp is not None else LlamaMLP(config, quant_config, f"{prefix}.mlp")
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
    """The decoder stack of this pipeline stage: layers ``[start_layer, end_layer)``
    (``pp_layer_range``; the others are ``PPMissingLayer``), the embedding on the first
    stage (and on the last when the LM head shares it), the final norm on the last. Each
    layer's attention window is ``pagedllm.arch_config.layer_sliding_windows``' (Mistral:
    ``sliding_window`` on all; Qwen2 / Qwen3: on the "sliding_attention" ``layer_types``)."""

    def __init__(
        self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool, quant_config: Optional[QuantizationConfig], prefix: str,
        make_mlp: MakeMLP = make_llama_mlp,
    ) -> None:
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.start_layer, self.end_layer = pp_layer_range(config.num_hidden_layers, pp.rank_in_group, pp.world_size)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.is_first_stage or (tied and self.is_last_stage):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = PPMissingLayer()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # One table for every layer (each attention layer holds this same module).
        self.rotary_emb = get_rope(head_dim, head_dim, config.max_position_embeddings, get_rope_parameters(config))
        windows = layer_sliding_windows(config)  # per layer, as transformers' code of the architecture
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, qkv_bias, qk_norm, self.rotary_emb, quant_config, f"{prefix}.layers.{i}", windows[i],
                make_mlp(config, i, quant_config, f"{prefix}.layers.{i}.mlp"),
            )
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()
        #: Layers whose input ``forward`` keeps in ``aux_hidden_states`` (an EAGLE-3 head reads them).
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        intermediate_tensors: Optional[dict[str, torch.Tensor]] = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """input_ids, positions [T] (int64) -> the final hidden states [T, hidden] on the
        last stage; on the others the ``IntermediateTensors`` for the next stage,
        ``{"hidden_states", "residual"}`` [T, hidden] each, which a stage after the first
        takes as ``intermediate_tensors`` instead of embedding ``input_ids``."""
        if self.is_first_stage:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            assert intermediate_tensors is not None
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        rope = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        captured = {}
        for i in range(self.start_layer, self.end_layer):
            if i in self.aux_hidden_state_layers:
                # A fresh tensor: the layers' norms overwrite their inputs in place.
                captured[i] = hidden_states.clone() if residual is None else hidden_states + residual
            hidden_states, residual = self.layers[i](rope, hidden_states, residual)
        self.aux_hidden_states = [captured[i] for i in sorted(self.aux_hidden_state_layers)]
        if not self.is_last_stage:
            return {"hidden_states": hidden_states, "residual": residual}
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``
    and ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` (model dtype). With pipeline
    parallelism this stage's part only (see ``LlamaModel``; the LM head on the last stage).

    Class attributes ``qkv_bias`` and ``qk_norm`` select the Qwen2 / Qwen3 variants.

    Args:
        config: the HF config.
        quant_config: picks each linear layer's and the lm_head's method (None: unquantized).
    """

    qkv_bias = False
    qk_norm = False
    stacked_params_mapping = STACKED_PARAMS_MAPPING
    #: Each layer's feed-forward block (``MakeMLP``); MoE variants return their expert block.
    make_mlp: staticmethod = staticmethod(make_llama_mlp)

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        self.model = LlamaModel(config, qkv_bias, self.qk_norm, quant_config, "model", self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
            if self.tie_word_embeddings:
                self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        intermediate_tensors: Optional[dict[str, torch.Tensor]] = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model dtype (the sampler upcasts once)."""
        return self.lm_head.compute_logits(hidden_states)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Keep, at each forward, the residual stream entering each of ``layers`` (vLLM's
        EAGLE-3 layer ids: 0 is the embeddings) in ``aux_hidden_states``."""
        self.model.aux_hidden_state_layers = layers

    @property
    def aux_hidden_states(self) -> list[torch.Tensor]:
        """The last forward's [T, hidden] inputs of ``set_aux_hidden_state_layers``' layers, one
        per id in increasing order (as vLLM; empty when none are set)."""
        return self.model.aux_hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters (``load_llama_weights``),
        skipping those of other pipeline stages' modules; returns the names loaded.

        Raises:
            ValueError: for a checkpoint tensor with no matching parameter, or a shape mismatch.
        """
        other_stages = tuple(f"{n}." for n, m in self.named_modules() if isinstance(m, PPMissingLayer))
        return load_llama_weights(self, (
            (name, tensor) for name, tensor in weights
            if "rotary_emb.inv_freq" not in name and not (self.tie_word_embeddings and name == "lm_head.weight")
            and not name.startswith(other_stages)
        ))


def load_llama_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy checkpoint tensors named as ``model``'s parameters (HF names: separate q/k/v
    and gate/up) into them through their ``weight_loader`` (this rank's part; q/k/v and
    gate/up into their fused layers); returns the parameter names loaded.

    Raises:
        ValueError: for a checkpoint tensor with no matching parameter, or a shape mismatch.
    """
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    loaded: set[str] = set()
    for name, tensor in weights:
        if load_kv_cache_scale(buffers, name, tensor):  # FP8 KV-cache k_scale / v_scale
            continue
        shard_id = None
        for fused_part, ckpt_part, sid in STACKED_PARAMS_MAPPING:
            if ckpt_part in name:
                name, shard_id = name.replace(ckpt_part, fused_part), sid
                break
        param = params.get(name)
        if param is None:
            raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}.")
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            default_weight_loader(param, tensor)
        elif shard_id is None:
            loader(param, tensor)
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
