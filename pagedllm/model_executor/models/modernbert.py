"""ModernBERT encoders: ``ModernBertModel`` for embeddings and ``ModernBertForSequenceClassification``
(classification and cross-encoder scores).

Architecture as transformers' ``modeling_modernbert`` (our own code): token embeddings, then
LayerNorm (no position table: rotary embeddings in every layer); per layer pre-LN blocks,
``h = h + Wo(attention(attn_norm(h)))`` (layer 0's ``attn_norm`` is the identity),
``h = h + Wo(gelu(input) * gate)`` over ``Wi(mlp_norm(h)) = [input | gate]`` (GeGLU); a
``final_norm`` after the last layer. Attention is bidirectional within each prompt; the
layers whose ``layer_types`` entry is "sliding_attention" (every layer but each
``global_attn_every_n_layers``-th, from 0) see only the keys within ``local_attention // 2``
positions either side of a query (transformers' ``sliding_window``), and use the rope base
of their layer type (``global_rope_theta`` / ``local_rope_theta``: 160000 / 10000 by
default). Projections and norms have no biases unless ``attention_bias`` / ``mlp_bias`` /
``norm_bias`` say so. No token types: a pair's packed types (``TOKEN_TYPE_SHIFT``) are dropped.

As BERT (``pagedllm.model_executor.models.bert``), each prompt is computed whole in one step
and no KV cache is kept. The classifier's ``pooler_head`` is transformers' ``head`` (dense,
``classifier_activation``, LayerNorm) and ``classifier`` on the state pooled by
``classifier_pooling`` ("cls" / "mean": the pooler's default, ``pagedllm.config.pooler``).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedllm.arch_config import GELU_ACTIVATIONS, get_rope_parameters
from pagedllm.model_executor.layers.activation import GeluAndMul
from pagedllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.rotary_embedding import get_rope
from pagedllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.model_executor.models.bert import bidirectional_attention, refuse_pipeline_parallel, sequence_bounds
from pagedllm.model_executor.models.llama import load_llama_weights
from pagedllm.pooling_params import TOKEN_TYPE_SHIFT

#: Fused checkpoint tensors -> the parts ``load_llama_weights`` loads into our fused layers:
#: ``Wqkv`` = [q | k | v]; ``Wi`` = [input | gate], the input half activated (GeGLU).
_FUSED_PARTS = {
    ".attn.Wqkv.": (".attn.q_proj.", ".attn.k_proj.", ".attn.v_proj."),
    ".mlp.Wi.": (".mlp.gate_proj.", ".mlp.up_proj."),
}
#: Checkpoint tensors an embedding model does not use: the masked-LM and task heads.
_UNUSED_PREFIXES = ("head.", "decoder.", "classifier.")
#: ... and those a sequence classifier does not use: the masked-LM decoder.
_CLASSIFIER_UNUSED_PREFIXES = ("decoder.",)


def _checkpoint_parts(weights: Iterable[tuple[str, torch.Tensor]], unused: tuple[str, ...]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors as ``load_llama_weights`` takes them: without a task model's ``model.``
    prefix, the fused ``Wqkv`` / ``Wi`` split into their parts (``_FUSED_PARTS``), ``unused``
    prefixes skipped."""
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name.startswith(unused):
            continue
        fused = next((key for key in _FUSED_PARTS if key in name), None)
        if fused is None:
            yield name, tensor
            continue
        parts = _FUSED_PARTS[fused]
        for part, chunk in zip(parts, tensor.chunk(len(parts), dim=0)):
            yield name.replace(fused, part), chunk


class ModernBertAttention(nn.Module):
    """Bidirectional self-attention within each prompt over this rank's heads, with rope of
    the layer type's base; a "sliding_attention" layer masks keys more than ``local_attention
    // 2`` positions from the query."""

    def __init__(self, config: PretrainedConfig, layer_type: str, quant_config: Optional[QuantizationConfig],
                 prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, config.num_attention_heads, bias=config.attention_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.Wqkv")
        self.num_heads = self.qkv_proj.num_heads
        self.Wo = RowParallelLinear(hidden, hidden, bias=config.attention_bias, quant_config=quant_config,
                                    prefix=f"{prefix}.Wo")
        self.rotary_emb = get_rope(self.head_dim, self.head_dim, config.max_position_embeddings,
                                   get_rope_parameters(config, layer_type),
                                   num_positions=config.max_position_embeddings)
        #: Keys at most this far from the query are seen (None: the whole prompt).
        self.window = config.local_attention // 2 if layer_type == "sliding_attention" else None

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.q_size, dim=-1)
        q, k, v = (x.view(-1, self.num_heads, self.head_dim) for x in (q, k, v))
        cos, sin = self.rotary_emb.cos_sin(positions, q.dtype)
        q, k = self.rotary_emb(q, k, cos, sin)
        return self.Wo(bidirectional_attention(q, k, v, bounds, self._mask))

    def _mask(self, length: int, device: torch.device) -> Optional[torch.Tensor]:
        """[length, length] bool, True where a query (row) sees a key; None: it sees all."""
        if self.window is None or length <= self.window + 1:
            return None
        index = torch.arange(length, device=device)
        return (index[:, None] - index[None, :]).abs() <= self.window


class ModernBertMLP(nn.Module):
    """GeGLU: ``Wo(gelu(input) * gate)`` over ``Wi(x) = [input | gate]`` (``hidden_activation``'s gelu)."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=config.mlp_bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.Wi")
        self.act = GeluAndMul(GELU_ACTIVATIONS[config.hidden_activation])
        self.Wo = RowParallelLinear(inter, config.hidden_size, bias=config.mlp_bias, quant_config=quant_config,
                                    prefix=f"{prefix}.Wo")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.Wo(self.act(self.gate_up_proj(hidden)))


def _layer_norm(config: PretrainedConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertLayer(nn.Module):
    """One pre-LN encoder layer, named as the checkpoint's ``layers.{i}``."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                 prefix: str) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if layer_idx == 0 else _layer_norm(config)
        self.attn = ModernBertAttention(config, config.layer_types[layer_idx], quant_config, f"{prefix}.attn")
        self.mlp_norm = _layer_norm(config)
        self.mlp = ModernBertMLP(config, quant_config, f"{prefix}.mlp")

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden), positions, bounds)
        return hidden + self.mlp(self.mlp_norm(hidden))


class ModernBertModel(nn.Module):
    """The encoder: ``forward(input_ids [T], positions [T]) -> final hidden states [T, hidden]``
    (model dtype, after ``final_norm``) over the whole prompts of a step; no LM head.

    Raises (constructor):
        ValueError: pipeline parallelism (``pagedllm.arch_config.check_hf_config`` refuses the
            config values not built, e.g. another ``hidden_activation``, before).
    """

    #: Checkpoint tensors (without the ``model.`` prefix) that are skipped.
    unused_prefixes = _UNUSED_PREFIXES

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        refuse_pipeline_parallel(self)
        self.config = config
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embeddings.norm = _layer_norm(config)
        self.layers = nn.ModuleList(
            ModernBertLayer(config, i, quant_config, f"layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.final_norm = _layer_norm(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        bounds = sequence_bounds(positions)
        input_ids = input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        hidden = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        for layer in self.layers:
            hidden = layer(hidden, positions, bounds)
        return self.final_norm(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (transformers' names, with or without a task model's
        ``model.`` prefix) into the parameters, ``Wqkv`` and ``Wi`` by parts into their fused
        layers; ``unused_prefixes`` are skipped. Returns the names loaded.

        Raises:
            ValueError: a checkpoint tensor with no matching parameter, or a shape mismatch.
        """
        return load_llama_weights(self, _checkpoint_parts(weights, self.unused_prefixes))


class ModernBertForSequenceClassification(ModernBertModel):
    """ModernBERT with transformers' classification head: ``pooler_head`` maps pooled states
    [n, hidden] to logits [n, num_labels] (float32) by ``head.dense``, ``classifier_activation``,
    ``head.norm``, then ``classifier``."""

    unused_prefixes = _CLASSIFIER_UNUSED_PREFIXES

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__(config, quant_config)
        self.head = nn.Module()
        self.head.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.head.norm = _layer_norm(config)
        self.head_act = ACT2FN[config.classifier_activation]
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        pooled = pooled.to(self.classifier.weight.dtype)
        return self.classifier(self.head.norm(self.head_act(self.head.dense(pooled)))).float()
