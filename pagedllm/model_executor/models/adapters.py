"""Decoder checkpoints as sequence classifiers (vLLM's ``as_seq_cls_model``): transformers'
``*ForSequenceClassification`` of a decoder, or ``--convert classify`` of its ``*ForCausalLM``.

The decoder runs as usual (causal attention, paged KV cache); the pooler takes the last
prompt token's final hidden state (LAST), and ``pooler_head`` is transformers' ``score``
layer (a bias-free linear map to ``num_labels`` logits), where transformers reads the last
non-padding token. There is no LM head: a checkpoint's ``lm_head.weight``, if any, is skipped.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.llama import PPMissingLayer


def as_seq_cls_model(base: type[nn.Module]) -> type[nn.Module]:
    """A subclass of the decoder ``base`` (a ``*ForCausalLM`` with ``lm_head``) named
    ``<family>ForSequenceClassification``, whose ``pooler_head`` maps pooled states
    [n, hidden] to logits [n, num_labels] (float32) by the checkpoint's ``score.weight``."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig] = None) -> None:
        base.__init__(self, config, quant_config)
        self.lm_head = PPMissingLayer()  # not built: its checkpoint tensor is skipped as another stage's
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled.to(self.score.weight.dtype)).float()

    name = base.__name__.removesuffix("ForCausalLM") + "ForSequenceClassification"
    return type(name, (base,), {"__init__": __init__, "pooler_head": pooler_head, "__doc__": (
        f"{base.__name__} with transformers' sequence-classification ``score`` head (``as_seq_cls_model``).")})
