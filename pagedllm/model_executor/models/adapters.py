"""Decoder checkpoints as sequence classifiers (vLLM's ``as_seq_cls_model``): transformers'
``*ForSequenceClassification`` of a decoder, or ``--convert classify`` of its ``*ForCausalLM``.

The decoder runs as usual (causal attention, paged KV cache); the pooler takes the last
prompt token's final hidden state (LAST), and ``pooler_head`` is transformers' ``score``
layer (a bias-free linear map to ``num_labels`` logits), where transformers reads the last
non-padding token. There is no LM head: a checkpoint's ``lm_head.weight``, if any, is skipped.

A causal LM's checkpoint has no ``score`` weight; with config.json's (or ``--hf-overrides``')
``classifier_from_token`` (vLLM's key) the head is made from the LM head's rows of those
tokens (``classifier_token_ids``, set by the loader): for two tokens [false, true] one row,
true's less false's (vLLM's "from_2_way_softmax": the sigmoid of that logit is the softmax
probability of true over the two), else the rows themselves, one label each.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

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
        #: The ``classifier_from_token`` ids (None: the checkpoint holds ``score.weight``).
        self.classifier_token_ids: Optional[list[int]] = None

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled.to(self.score.weight.dtype)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.classifier_token_ids is None:
            return base.load_weights(self, weights)
        kept: dict[str, torch.Tensor] = {}

        def keep_lm_head(items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                if name in ("lm_head.weight", "model.embed_tokens.weight"):
                    kept[name] = tensor
                yield name, tensor

        loaded = base.load_weights(self, keep_lm_head(weights))
        lm_head = kept.get("lm_head.weight", kept.get("model.embed_tokens.weight"))
        if lm_head is None:
            raise ValueError("classifier_from_token needs the checkpoint's lm_head.weight (or tied embeddings).")
        self.score.weight.data.copy_(score_from_lm_head(lm_head, self.classifier_token_ids))
        return loaded | {"score.weight"}

    name = base.__name__.removesuffix("ForCausalLM") + "ForSequenceClassification"
    return type(name, (base,), {"__init__": __init__, "pooler_head": pooler_head, "load_weights": load_weights,
                                "__doc__": f"{base.__name__} with transformers' sequence-classification ``score`` "
                                           "head (``as_seq_cls_model``)."})


def classifier_token_ids(tokenizer: Any, tokens: list[str]) -> list[int]:
    """The ids of ``classifier_from_token``'s tokens (each one token of the vocabulary, as vLLM).

    Raises:
        ValueError: a token the tokenizer does not hold as one token.
    """
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"classifier_from_token {unknown} are not tokens of the tokenizer's vocabulary.")
    return ids


def score_from_lm_head(lm_head: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """The score weight [num_labels, hidden] from LM-head rows [vocab, hidden]: row true less
    row false for two tokens [false, true], else the rows of ``token_ids``."""
    if len(token_ids) == 2:
        return (lm_head[token_ids[1]].float() - lm_head[token_ids[0]].float())[None]
    return lm_head[token_ids]
