"""The token embedding and the output projection (lm_head), each split by vocabulary rows
across tensor-parallel ranks (vLLM's ``VocabParallelEmbedding`` and ``ParallelLMHead``).

No padding: each rank holds ``vocab_size / tp_size`` rows, so the vocabulary must divide by
``tp_size`` (``ParallelConfig.verify_with_model_config`` refuses other sizes at start-up).
vLLM pads each rank's rows to a multiple of 64 so that any vocabulary splits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedllm.model_executor.layers.linear import UnquantizedLinearMethod
from pagedllm.model_executor.layers.quantization import QuantizationConfig, QuantizeMethodBase
from pagedllm.model_executor.utils import load_weight_part, set_weight_attrs


class UnquantizedEmbeddingMethod(UnquantizedLinearMethod):
    """The lm_head's default method: ``UnquantizedLinearMethod``'s weight and matmul, without
    float32 copies (a vocab x hidden float32 copy is large — 544 MB for Qwen2.5-0.5B — and
    the many-row logits it would serve are rare: prompt logprobs).

    For tied embeddings the lm_head's ``weight`` is the embedding table: on CPU the packed
    layout then becomes a new parameter of the lm_head, and the table stays plain for the
    lookup (vocab x hidden more bytes; 272 MB for Qwen2.5-0.5B in bf16).
    """

    float32_copy = False


class VocabParallelEmbedding(nn.Module):
    """Token embedding: ids [T] (int64) -> [T, embedding_dim]; this rank holds rows
    [vocab_start_index, vocab_end_index) of the [num_embeddings, embedding_dim] table in
    ``weight`` (``params_dtype``; None: torch's default dtype), plain for the lookup.

    Raises:
        ValueError: a vocabulary not divisible by the tensor-parallel size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self._create_weights()

    def _create_weights(self) -> None:
        """Register ``weight``, this rank's [num_embeddings_per_partition, embedding_dim] rows."""
        weight = torch.empty(self.num_embeddings_per_partition, self.embedding_dim, dtype=self.params_dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the checkpoint's [num_embeddings, embedding_dim] table.

        Raises:
            ValueError: a wrong shape.
        """
        load_weight_part(param.data, loaded_weight, getattr(param, "output_dim", None), self.tp_rank, self.tp_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] (int64) -> [..., embedding_dim] in the table's dtype. Across
        ranks, each looks up its own rows (zeros for other ids) and the results are summed."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill_(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection: hidden [N, embedding_dim] -> logits [N, num_embeddings]
    (``compute_logits``), this rank computing the logits of its vocabulary rows. Its
    ``quant_method`` (from ``quant_config.get_quant_method(self, prefix)``; None:
    ``UnquantizedEmbeddingMethod``) creates, prepares and applies the weight like a linear
    layer's; ``output_size_per_partition`` is this rank's vocabulary rows.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: Optional[torch.dtype] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ) -> None:
        # Chosen before the base class's __init__, which creates the weight through it.
        method = None if quant_config is None else quant_config.get_quant_method(self, prefix)
        self.quant_method: QuantizeMethodBase = method or UnquantizedEmbeddingMethod()
        super().__init__(num_embeddings, embedding_dim, params_dtype)

    def _create_weights(self) -> None:
        self.output_size_per_partition = self.num_embeddings_per_partition
        self.quant_method.create_weights(
            self, self.embedding_dim, [self.num_embeddings_per_partition], self.embedding_dim,
            self.num_embeddings, self.params_dtype, weight_loader=self.weight_loader,
        )

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        """Use ``embed_tokens``' table as this layer's weight (tied embeddings)."""
        self.weight = embed_tokens.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, embedding_dim] -> logits [N, num_embeddings], hidden's dtype."""
        logits = self.quant_method.apply(self, hidden_states)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits)
        return logits
