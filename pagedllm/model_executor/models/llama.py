"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Architecture as in the HF transformers implementations of the same names; our own code,
with fused q/k/v and gate/up projections (tensor-parallel layers: this rank's heads and
MLP columns) and attention over the paged KV cache.

Its pieces are the shared blocks of the other dense architectures (olmo2, granite, gemma2,
gemma3, phi3, glm4): ``LlamaAttention`` (scale, o_proj bias, q/k norm, soft cap as
arguments), ``LlamaMLP`` (any gated activation), ``DecoderLayer`` (norms before and / or
after each block, by their checkpoint names) and ``LlamaModel`` / ``LlamaForCausalLM``,
whose hooks a variant overrides (``model_cls``, ``make_mlp``, ``make_layer``,
``rotary_embeddings``, ``embedding_scale``, ``norm_cls``, ``compute_logits``).
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.arch_config import layer_sliding_windows
from pagedllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from pagedllm.model_executor.layers.activation import SiluAndMul
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pagedllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_executor.kv_cache_scales import load_kv_cache_scale
from pagedllm.model_executor.models.pipeline_stage import PipelineStage, PPMissingLayer, without_other_stages
from pagedllm.model_executor.utils import default_weight_loader, load_weight_part, set_weight_attrs
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


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads: ``qkv_proj.num_heads`` query heads and
    ``qkv_proj.num_kv_heads`` KV heads (all of them at tensor-parallel size 1); with
    ``sliding_window`` W, a query at position i attends to keys i - W + 1 .. i only.

    ``qk_norm``: a ``norm_cls`` over each query and key head before rope (Qwen3; Gemma 3 with
    ``GemmaRMSNorm``). ``scale``: the softmax scale (None: head_dim ** -0.5). ``o_bias``: a
    bias on o_proj (None: ``attention_bias``, as Llama). ``logits_soft_cap`` C: scores become
    C * tanh(scores / C) before the softmax (Gemma 2; None: none). ``sinks``: a learned logit per
    query head in every softmax's denominator (gpt-oss): the float32 parameter ``sinks`` [this
    rank's heads], loaded from the checkpoint's [num_attention_heads] split as the heads are.
    ``output_gate``: q_proj gives each head's query and then its output gate (Qwen3-Next), so
    ``qkv_proj``'s "q" part is twice the heads' width; a subclass's ``forward`` applies the gate.
    ``attention_chunk_size`` C: chunked local attention, a query at position i attends to keys
    i - i % C .. i only (Llama 4; None: none).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        qkv_bias: bool,
        qk_norm: bool,
        rotary_emb: RotaryEmbedding,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
        sliding_window: Optional[int] = None,
        *,
        scale: Optional[float] = None,
        o_bias: Optional[bool] = None,
        norm_cls: type[nn.Module] = RMSNorm,
        logits_soft_cap: Optional[float] = None,
        sinks: bool = False,
        output_gate: bool = False,
        attention_chunk_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_num_heads
        q_widths = 2 if output_gate else 1
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_num_heads * q_widths, total_num_kv_heads, bias=qkv_bias,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads // q_widths
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        # ``attention_bias`` (Llama, Qwen3) puts a bias on q, k, v and o; Qwen2 has q/k/v bias only.
        if o_bias is None:
            o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(
            total_num_heads * self.head_dim, hidden, bias=o_bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = norm_cls(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm_cls(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        scale = self.head_dim**-0.5 if scale is None else scale
        self.sinks: Optional[nn.Parameter] = None
        if sinks:
            tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(self.sinks, {
                "weight_loader": lambda param, w: load_weight_part(param.data, w, 0, tp_rank, tp_size)})
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, scale, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, sinks=self.sinks, attention_chunk_size=attention_chunk_size,
        )

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        num_tokens = hidden_states.shape[0]
        q, k = self.norm_qk(
            q.reshape(num_tokens, self.num_heads, self.head_dim), k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        )
        q, k = self.rotary_emb(q, k, *rope)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.contiguous())
        return self.o_proj(out)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] as rope takes them:
        each head normed with ``qk_norm``, else as they are."""
        if self.qk_norm:
            return self.q_norm(q), self.k_norm(k)
        return q, k


class LlamaMLP(nn.Module):
    """Gated MLP, down(act(gate(x)) * up(x)); this rank's ``intermediate_size / tp_size``
    columns (``intermediate_size`` None: the config's; a mixture-of-experts model's shared
    expert passes its own). ``act_fn``: the gated activation on [gate | up] (None:
    ``SiluAndMul``, SwiGLU)."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str,
                 intermediate_size: Optional[int] = None, act_fn: Optional[nn.Module] = None) -> None:
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
        self.act_fn = SiluAndMul() if act_fn is None else act_fn
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


class NormNames(NamedTuple):
    """The checkpoint names of a decoder layer's norms by role (None: the layer has none there):
    before and after the attention block, before and after the feed-forward block."""

    pre_attn: Optional[str]
    post_attn: Optional[str]
    pre_mlp: Optional[str]
    post_mlp: Optional[str]


#: Llama's pre-norm layer: ``input_layernorm`` before attention, ``post_attention_layernorm`` before the MLP.
LLAMA_NORMS = NormNames("input_layernorm", None, "post_attention_layernorm", None)


class DecoderLayer(nn.Module):
    """One transformer layer on the residual stream h, each block between optional norms::

        h = h + m * post_attn(self_attn(pre_attn(h)))
        h = h + m * post_mlp(mlp(pre_mlp(h)))

    (m: ``residual_multiplier``, Granite; None: 1). ``norm_names`` names the norms as the
    checkpoint does (``NormNames``), each a ``make_norm()``. The stream travels as
    ``(hidden_states, residual)``: a block's output not yet added, so the add fuses into the
    next norm (``forward``).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, norm_names: NormNames,
                 make_norm: Callable[[], nn.Module], residual_multiplier: Optional[float] = None) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        for name in norm_names:
            if name is not None:
                setattr(self, name, make_norm())
        # By role (plain attributes: the modules are registered under their checkpoint names).
        self._norms = tuple(None if name is None else getattr(self, name) for name in norm_names)
        self.residual_multiplier = residual_multiplier

    def forward(self, rope, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]):
        """(hidden_states, residual) [T, hidden] each (residual None: hidden_states is the
        stream itself, at the first layer) -> the same pair after this layer. The norms may
        overwrite their inputs in place."""
        pre_attn, post_attn, pre_mlp, post_mlp = self._norms
        hidden_states, residual = _add_and_norm(pre_attn, hidden_states, residual)
        hidden_states = self._branch(self.self_attn(rope, hidden_states), post_attn)
        hidden_states, residual = _add_and_norm(pre_mlp, hidden_states, residual)
        return self._branch(self.mlp(hidden_states), post_mlp), residual

    def _branch(self, out: torch.Tensor, post_norm: Optional[nn.Module]) -> torch.Tensor:
        if post_norm is not None:
            out = post_norm(out)
        if self.residual_multiplier is not None:
            out = out.mul_(self.residual_multiplier)  # a block's output is a fresh tensor
        return out


def _add_and_norm(norm: Optional[nn.Module], hidden_states: torch.Tensor, residual: Optional[torch.Tensor]):
    """(norm(stream), stream) with stream = hidden_states + residual (hidden_states alone when
    residual is None); without a norm the stream itself, which the block must not modify."""
    if residual is None:
        return (hidden_states if norm is None else norm(hidden_states)), hidden_states
    if norm is None:
        stream = hidden_states + residual
        return stream, stream
    return norm(hidden_states, residual)


class LlamaDecoderLayer(DecoderLayer):
    """Llama's layer (``LLAMA_NORMS``): ``LlamaAttention``, then ``mlp`` (None: ``LlamaMLP``, built
    after the attention, as are ``make_mlp``'s)."""

    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool, rotary_emb: RotaryEmbedding,
                 quant_config: Optional[QuantizationConfig], prefix: str, sliding_window: Optional[int] = None,
                 mlp: Optional[nn.Module] = None) -> None:
        attn = LlamaAttention(config, qkv_bias, qk_norm, rotary_emb, quant_config, f"{prefix}.self_attn", sliding_window)
        super().__init__(
            attn, mlp if mlp is not None else LlamaMLP(config, quant_config, f"{prefix}.mlp"), LLAMA_NORMS,
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )


class LlamaModel(nn.Module):
    """The decoder stack of this pipeline stage: layers ``[start_layer, end_layer)``
    (``PipelineStage``; the others are ``PPMissingLayer``), the embedding on the first
    stage (and on the last when the LM head shares it), the final norm on the last. Each
    layer's attention window is ``pagedllm.arch_config.layer_sliding_windows``' (Mistral:
    ``sliding_window`` on all; Qwen2 / Qwen3: on the "sliding_attention" ``layer_types``).

    A variant overrides the hooks: ``norm_cls`` (the final norm's class), ``embedding_scale``
    (a factor on the embeddings), ``rotary_embeddings`` (the rope table of each layer) and
    ``make_layer`` (one decoder layer).
    """

    norm_cls: type[nn.Module] = RMSNorm

    def __init__(
        self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool, quant_config: Optional[QuantizationConfig], prefix: str,
        make_mlp: MakeMLP = make_llama_mlp,
    ) -> None:
        super().__init__()
        self.qkv_bias, self.qk_norm, self.make_mlp = qkv_bias, qk_norm, make_mlp
        self.stage = stage = PipelineStage.of(config.num_hidden_layers)
        self.is_first_stage, self.is_last_stage = stage.is_first, stage.is_last
        self.start_layer, self.end_layer = stage.start_layer, stage.end_layer
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = stage.held(stage.is_first or (tied and stage.is_last),
                                       lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size))
        scale = self.embedding_scale(config)
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale, persistent=False)
        else:
            self.embed_scale = scale
        tables, self.layer_rope = self.rotary_embeddings(config)
        # Each table computed once per forward; each attention layer holds its own layer's.
        self.rotary_embs = nn.ModuleList(tables)
        self.rotary_emb = tables[0]
        windows = layer_sliding_windows(config)  # per layer, as transformers' code of the architecture
        self.layers = stage.make_layers(config.num_hidden_layers, lambda i: self.make_layer(
            config, i, tables[self.layer_rope[i]], windows[i], quant_config, f"{prefix}.layers.{i}"))
        self.norm = stage.held(stage.is_last, lambda: self.norm_cls(config.hidden_size, config.rms_norm_eps))
        #: Layers whose input ``forward`` keeps in ``aux_hidden_states`` (an EAGLE-3 head reads them).
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first layer's input [T, hidden]: the token embeddings, times
        ``embedding_scale`` where the variant has one."""
        embeds = self.embed_tokens(input_ids)
        return embeds if self.embed_scale is None else embeds * self.embed_scale

    def embedding_scale(self, config: PretrainedConfig) -> Optional[float | torch.Tensor]:
        """The factor on the token embeddings (None: none; a 0-d tensor multiplies in its dtype)."""
        return None

    def rotary_embeddings(self, config: PretrainedConfig) -> tuple[list[nn.Module], list[int]]:
        """(the rope tables, each layer's index into them): one table for every layer here,
        rotating every channel (the Llama family refuses ``partial_rotary_factor``)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        table = get_rope(head_dim, head_dim, config.max_position_embeddings, get_rope_parameters(config))
        return [table], [0] * config.num_hidden_layers

    def make_layer(self, config: PretrainedConfig, layer_idx: int, rotary_emb: nn.Module, sliding_window: Optional[int],
                   quant_config: Optional[QuantizationConfig], prefix: str) -> nn.Module:
        """Decoder layer ``layer_idx`` (``forward(rope, hidden_states, residual)`` as ``DecoderLayer``'s):
        its attention, then its feed-forward block ``self.make_mlp(config, layer_idx, quant_config,
        f"{prefix}.mlp")``."""
        attn = LlamaAttention(
            config, self.qkv_bias, self.qk_norm, rotary_emb, quant_config, f"{prefix}.self_attn", sliding_window
        )
        mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        return DecoderLayer(attn, mlp, LLAMA_NORMS, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        intermediate_tensors: Optional[dict[str, torch.Tensor]] = None, inputs_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """input_ids, positions [T] (int64) -> the final hidden states [T, hidden] on the
        last stage; on the others the ``IntermediateTensors`` for the next stage,
        ``{"hidden_states", "residual"}`` [T, hidden] each, which a stage after the first
        takes as ``intermediate_tensors`` instead of embedding ``input_ids``. ``inputs_embeds``
        [T, hidden] (an image-text model's: ``embed_input_ids`` with the images merged in)
        replaces ``embed_input_ids(input_ids)``."""
        hidden_states, residual = self.stage.inputs(
            intermediate_tensors, lambda: self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds)
        ropes = [table.cos_sin(positions, hidden_states.dtype) for table in self.rotary_embs]
        captured = {}
        for i in range(self.start_layer, self.end_layer):
            if i in self.aux_hidden_state_layers:
                # A fresh tensor: the layers' norms overwrite their inputs in place.
                captured[i] = hidden_states.clone() if residual is None else hidden_states + residual
            hidden_states, residual = self.layers[i](ropes[self.layer_rope[i]], hidden_states, residual)
        self.aux_hidden_states = [captured[i] for i in sorted(self.aux_hidden_state_layers)]
        return self.stage.outputs(hidden_states, residual, self.norm)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``
    and ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` (model dtype). With pipeline
    parallelism this stage's part only (see ``LlamaModel``; the LM head on the last stage).

    Class attributes ``qkv_bias`` and ``qk_norm`` select the Qwen2 / Qwen3 variants;
    ``model_cls`` is the decoder stack (a ``LlamaModel`` with its variant's hooks).

    Args:
        config: the HF config.
        quant_config: picks each linear layer's and the lm_head's method (None: unquantized).
    """

    qkv_bias = False
    qk_norm = False
    stacked_params_mapping = STACKED_PARAMS_MAPPING
    #: Each layer's feed-forward block (``MakeMLP``); MoE variants return their expert block.
    make_mlp: staticmethod = staticmethod(make_llama_mlp)
    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        self.model = self.model_cls(config, qkv_bias, self.qk_norm, quant_config, "model", self.make_mlp)
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
        return load_llama_weights(self, without_other_stages(self, (
            (name, tensor) for name, tensor in weights
            if "rotary_emb.inv_freq" not in name and not (self.tie_word_embeddings and name == "lm_head.weight")
        )))


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
