"""Mamba-2 (``Mamba2ForCausalLM``): a stack of pre-norm residual blocks, each an RMSNorm and
a ``MambaMixer2`` (no attention, no MLP), then a final RMSNorm and the LM head, as
transformers' ``modeling_mamba2`` (our own code). Every layer keeps a recurrent state per
request in the state cache; the KV cache holds no attention block."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2, mamba2_state_shape
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_executor.models.llama import load_llama_weights
from pagedllm.model_executor.models.pipeline_stage import IntermediateTensors, PipelineStage, without_other_stages


class Mamba2DecoderLayer(nn.Module):
    """h = h + mixer(norm(h)) (transformers' ``Mamba2Block``), the stream travelling as
    (hidden_states, residual) as ``llama.DecoderLayer``'s."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = MambaMixer2(
            config.hidden_size, int(config.expand * config.hidden_size), config.num_heads, config.head_dim,
            config.n_groups, config.state_size, config.conv_kernel, config.chunk_size, config.use_conv_bias,
            config.use_bias, config.layer_norm_epsilon, config.time_step_limit, quant_config, f"{prefix}.mixer",
        )

    def forward(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]):
        if residual is None:
            residual, hidden_states = hidden_states, self.norm(hidden_states)
        else:
            hidden_states, residual = self.norm(hidden_states, residual)
        return self.mixer(hidden_states), residual


class Mamba2ForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, hidden]`` and
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]``; parameters under transformers'
    names (``backbone.embeddings``, ``backbone.layers.i.{norm, mixer}``, ``backbone.norm_f``,
    ``lm_head``; an old checkpoint's ``backbone.embedding`` is read too). With pipeline
    parallelism this stage's part only (``PipelineStage``: its layers, the embeddings on the
    first stage, ``norm_f`` and the LM head on the last; ``forward`` then takes and returns
    ``IntermediateTensors`` between stages, as ``LlamaModel``'s).

    ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` (vLLM's
    names) give each layer's state for the KV-cache sizing, before the model is built.
    """

    mamba_type = "mamba2"

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        self.config = config
        self.stage = stage = PipelineStage.of(config.num_hidden_layers)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.backbone = nn.Module()
        self.backbone.embeddings = stage.held(stage.is_first or (self.tie_word_embeddings and stage.is_last),
                                              lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size))
        self.backbone.layers = stage.make_layers(
            config.num_hidden_layers, lambda i: self.make_layer(config, i, quant_config, f"backbone.layers.{i}"))
        self.backbone.norm_f = stage.held(stage.is_last,
                                          lambda: RMSNorm(config.hidden_size, config.layer_norm_epsilon))
        self.lm_head = stage.held(stage.is_last, lambda: ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head"))
        if self.tie_word_embeddings and stage.is_last:
            self.lm_head.tie_weights(self.backbone.embeddings)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                   prefix: str) -> nn.Module:
        """Layer ``layer_idx`` (``forward(hidden_states, residual)`` as ``Mamba2DecoderLayer``'s; a
        variant's hook): a ``Mamba2DecoderLayer``."""
        return Mamba2DecoderLayer(config, quant_config, prefix)

    @classmethod
    def get_mamba_state_shape_from_config(cls, config: PretrainedConfig,
                                          tp_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """Each layer's (conv, ssm) state shapes per slot on each of ``tp_size`` ranks
        (``mamba2_state_shape``)."""
        return mamba2_state_shape(int(config.expand * config.hidden_size), config.n_groups, config.num_heads,
                                  config.head_dim, config.state_size, config.conv_kernel, tp_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, config: PretrainedConfig, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The states' dtypes: the model's ``dtype`` for both (vLLM's "auto")."""
        return dtype, dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: Optional[IntermediateTensors] = None) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] (int64; a state carries the order, positions are unused) ->
        the final hidden states [T, hidden] on the last stage, the ``IntermediateTensors`` for
        the next stage on the others (``PipelineStage.outputs``)."""
        del positions
        stage = self.stage
        hidden_states, residual = stage.inputs(intermediate_tensors, lambda: self.backbone.embeddings(input_ids))
        for i in range(stage.start_layer, stage.end_layer):
            hidden_states, residual = self.backbone.layers[i](hidden_states, residual)
        return stage.outputs(hidden_states, residual, self.backbone.norm_f)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model dtype."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters by name, skipping those of other pipeline
        stages' modules; returns the names loaded.

        Raises:
            ValueError: for a checkpoint tensor with no matching parameter, or a shape mismatch.
        """
        return load_llama_weights(self, without_other_stages(self, (
            (name.replace("backbone.embedding.", "backbone.embeddings."), tensor) for name, tensor in weights
            if not (self.tie_word_embeddings and name == "lm_head.weight")
        )))
