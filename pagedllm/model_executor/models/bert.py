"""BERT-style encoders: ``BertModel``, ``RobertaModel`` / ``XLMRobertaModel`` for embeddings, and
their ``*ForSequenceClassification`` heads (classification and cross-encoder scores).

Architecture as transformers' ``modeling_bert`` / ``modeling_roberta`` (our own code):
token + absolute position + token-type embeddings, LayerNorm; then per layer
post-LN blocks, ``h = LN(h + dense(attention(h)))``, ``h = LN(h + out(act(inter(h))))``,
with bidirectional attention over each whole prompt. RoBERTa numbers positions from
``pad_token_id + 1`` (padding tokens get ``pad_token_id``), as transformers'
``create_position_ids_from_input_ids``. A token's type (a cross-encoder's second segment: 1)
comes packed in its id (``pagedllm.pooling_params.encode_token_type_ids``); plain ids are type 0.

An encoder needs its whole prompt in one pass: the engine schedules each prompt whole (no
chunked prefill, ``SchedulerConfig.chunked_prefill_enabled``), and the model finds the
prompts of a step where the positions restart at 0. It keeps no KV cache. The final
hidden states go to the pooler (CLS by default); BERT's own ``pooler`` (dense + tanh) is
not used by the embedding model (sentence-transformers reads the last hidden states too) and
not loaded; a classifier applies it, then its ``classifier``, to the pooled CLS state
(``pooler_head``, as transformers' ``BertForSequenceClassification``; RoBERTa's
``classifier.dense`` + tanh + ``classifier.out_proj``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedllm.distributed import get_pp_group
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.model_executor.models.llama import load_llama_weights
from pagedllm.pooling_params import TOKEN_TYPE_SHIFT

#: Checkpoint name parts -> the names ``load_llama_weights`` loads (q/k/v into ``qkv_proj``).
_RENAMES = (
    (".attention.self.query.", ".attention.q_proj."),
    (".attention.self.key.", ".attention.k_proj."),
    (".attention.self.value.", ".attention.v_proj."),
    (".attention.output.", ".attention."),
)
#: Checkpoint tensors an embedding model does not use: BERT's pooler and task heads.
_UNUSED_PREFIXES = ("pooler.", "cls.", "lm_head.", "classifier.")
#: ... and those a sequence classifier does not use: the language-model heads.
_CLASSIFIER_UNUSED_PREFIXES = ("cls.", "lm_head.")


def sequence_bounds(positions: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each prompt in a step's flattened tokens: a prompt starts where its
    position is 0.

    Raises:
        ValueError: the first position is not 0 (a prompt cut into chunks: an encoder
            computes each prompt whole).
    """
    if positions.numel() == 0:
        return []
    if int(positions[0]) != 0:
        raise ValueError(f"An encoder computes each prompt in one step, but this step starts at position "
                         f"{int(positions[0])} of a prompt (chunked prefill).")
    starts = torch.nonzero(positions == 0).flatten().tolist()
    return list(zip(starts, starts[1:] + [positions.numel()]))


def bidirectional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[tuple[int, int]],
    mask: Optional[Callable[[int, torch.device], Optional[torch.Tensor]]] = None,
) -> torch.Tensor:
    """Attention of each prompt of ``bounds`` over its own tokens, both ways: q, k, v [T, heads,
    head_dim] -> [T, heads * head_dim]. ``mask(length, device)``: a prompt's [length, length] bool mask
    (True: the query row sees the key column; None: all). Prompts of one length go through one
    ``scaled_dot_product_attention`` call, as a batch (no padding); a prompt whose length no
    other has is read in place (views of its rows, no gather). The outputs are joined in one copy."""
    _, num_heads, head_dim = q.shape
    if not bounds:
        return q.new_empty(0, num_heads * head_dim)
    starts_by_length: dict[int, list[int]] = {}
    for start, end in bounds:
        starts_by_length.setdefault(end - start, []).append(start)
    pieces: dict[int, torch.Tensor] = {}  # start -> [length, heads * head_dim]
    for length, starts in starts_by_length.items():
        attn_mask = mask(length, q.device) if mask else None
        if len(starts) == 1:
            # NOTE: [1, heads, length, head_dim] views keep SDPA on its fused CPU kernel.
            heads = [x[starts[0]:starts[0] + length].transpose(0, 1)[None] for x in (q, k, v)]
        else:
            rows = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
            heads = [x.index_select(0, rows).view(len(starts), length, num_heads, head_dim).transpose(1, 2)
                     for x in (q, k, v)]
        attn = torch.nn.functional.scaled_dot_product_attention(*heads, attn_mask=attn_mask)
        pieces.update(zip(starts, attn.transpose(1, 2).reshape(len(starts), length, -1).unbind(0)))
    if len(bounds) == 1:
        return pieces[bounds[0][0]].contiguous()
    return torch.cat([pieces[start] for start, _ in bounds])


def refuse_pipeline_parallel(model: nn.Module) -> None:
    """Raises ``ValueError`` when pipeline parallelism is on: an encoder is not split into stages."""
    if get_pp_group().world_size > 1:
        raise ValueError(f"{type(model).__name__} with pipeline parallelism is not supported yet.")


def _parameter_name(name: str) -> str:
    """A checkpoint tensor's name as ``load_llama_weights`` takes it: without a task model's
    ``bert.`` / ``roberta.`` prefix, the attention's parts renamed (``_RENAMES``)."""
    name = name.removeprefix("bert.").removeprefix("roberta.")
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


class BertEmbedding(nn.Module):
    """Token + position + token-type embeddings, then LayerNorm. ``position_offset``:
    RoBERTa's padding index (None: BERT's positions, 0-based)."""

    def __init__(self, config: PretrainedConfig, position_offset: Optional[int]) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                bounds: list[tuple[int, int]]) -> torch.Tensor:
        """input_ids (token types packed above ``TOKEN_TYPE_SHIFT``), positions [T] (0-based
        within each prompt of ``bounds``) -> [T, hidden]."""
        token_types = input_ids >> TOKEN_TYPE_SHIFT
        input_ids = input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        if self.position_offset is not None:
            positions = self._padded_positions(input_ids, bounds)
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(hidden + self.token_type_embeddings(token_types))

    def _padded_positions(self, input_ids: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """RoBERTa's positions: within each prompt, the count of non-padding tokens so far
        (the token included) + the padding index; a padding token's is the padding index."""
        pad = self.position_offset
        mask = (input_ids != pad).long()
        counts = torch.cat([torch.cumsum(mask[start:end], dim=0) for start, end in bounds])
        return counts * mask + pad


class BertAttention(nn.Module):
    """Bidirectional self-attention within each prompt over this rank's heads, then the
    output dense layer and the post-LN residual (transformers' ``attention.self`` and
    ``attention.output``)."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, config.num_attention_heads, bias=True,
                                          quant_config=quant_config, prefix=f"{prefix}.self.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.dense = RowParallelLinear(hidden, hidden, bias=True, quant_config=quant_config,
                                       prefix=f"{prefix}.output.dense")
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        q, k, v = (x.view(-1, self.num_heads, self.head_dim)
                   for x in self.qkv_proj(hidden).split(self.qkv_proj.q_size, dim=-1))
        return self.LayerNorm(self.dense(bidirectional_attention(q, k, v, bounds)) + hidden)


class BertLayer(nn.Module):
    """One encoder layer (post-LN), named as the checkpoint's ``encoder.layer.{i}``."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        self.attention = BertAttention(config, quant_config, f"{prefix}.attention")
        self.intermediate = nn.Module()
        self.intermediate.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True,
                                                       quant_config=quant_config, prefix=f"{prefix}.intermediate.dense")
        self.output = nn.Module()
        self.output.dense = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True,
                                              quant_config=quant_config, prefix=f"{prefix}.output.dense")
        self.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        hidden = self.attention(hidden, bounds)
        out = self.output.dense(self.act(self.intermediate.dense(hidden)))
        return self.output.LayerNorm(out + hidden)


class BertModel(nn.Module):
    """The encoder: ``forward(input_ids [T], positions [T]) -> final hidden states [T, hidden]``
    (model dtype) over the whole prompts of a step (see the module docstring); no LM head.

    Raises (constructor):
        ValueError: pipeline parallelism (``pagedllm.arch_config.check_hf_config`` refuses the
            config values not built, e.g. ``is_decoder``, before).
    """

    #: False: BERT's 0-based positions; True: RoBERTa's, offset by the padding index.
    padded_positions = False
    #: Checkpoint tensors (without the ``bert.`` / ``roberta.`` prefix) that are skipped.
    unused_prefixes = _UNUSED_PREFIXES

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        refuse_pipeline_parallel(self)
        self.config = config
        offset = config.pad_token_id if self.padded_positions else None
        self.embeddings = BertEmbedding(config, offset)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            BertLayer(config, quant_config, f"encoder.layer.{i}") for i in range(config.num_hidden_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        bounds = sequence_bounds(positions)
        hidden = self.embeddings(input_ids, positions, bounds)
        for layer in self.encoder.layer:
            hidden = layer(hidden, bounds)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (transformers' names, with or without the ``bert.`` /
        ``roberta.`` prefix of a task model) into the parameters, q/k/v into their fused
        layer; ``unused_prefixes`` (an embedder: BERT's pooler and task heads) are skipped. Returns the names loaded.

        Raises:
            ValueError: a checkpoint tensor with no matching parameter, or a shape mismatch.
        """
        return load_llama_weights(self, (
            (_parameter_name(name), tensor) for name, tensor in weights
            if not name.removeprefix("bert.").removeprefix("roberta.").startswith(self.unused_prefixes)
            and not name.endswith("position_ids")
        ))


class RobertaModel(BertModel):
    """RoBERTa: BERT with positions offset by the padding index (``padded_positions``)."""

    padded_positions = True


class XLMRobertaModel(RobertaModel):
    pass


class BertForSequenceClassification(BertModel):
    """BERT with transformers' sequence-classification head: ``pooler_head`` maps pooled CLS
    states [n, hidden] to logits [n, num_labels] (float32) by ``pooler.dense`` + tanh, then
    ``classifier``."""

    unused_prefixes = _CLASSIFIER_UNUSED_PREFIXES

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__(config, quant_config)
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        pooled = pooled.to(self.classifier.weight.dtype)
        return self.classifier(torch.tanh(self.pooler.dense(pooled))).float()


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa with transformers' classification head: ``pooler_head`` maps pooled ``<s>``
    states [n, hidden] to logits [n, num_labels] (float32) by ``classifier.dense`` + tanh,
    then ``classifier.out_proj``."""

    unused_prefixes = _CLASSIFIER_UNUSED_PREFIXES

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__(config, quant_config)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        pooled = pooled.to(self.classifier.dense.weight.dtype)
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(pooled))).float()


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    pass
