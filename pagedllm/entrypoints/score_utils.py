"""Text pairs for scoring, shared by ``LLM.score`` and ``/v1/score`` / ``/v1/rerank`` (vLLM's
``score_utils``): how two text inputs pair up, a cross-encoder's pair prompt, the cosine of
two embeddings.

A sequence classifier (``ModelConfig.is_classifier``) scores a pair as one input (the
tokenizer's pair encoding, with BERT's token types); an embedding model embeds both texts
and scores their cosine similarity (a bi-encoder), as vLLM's score API.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

from pagedllm.config import ModelConfig


def score_pairs(text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score, as vLLM pairs them: one text_1 with each text_2
    (1:1, 1:N), or the texts one by one (N:N).

    Raises:
        ValueError: an empty input, a non-string item, or lengths other than 1:N or N:N.
    """
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("At least one text element must be given in each of text_1 and text_2.")
    if not all(isinstance(t, str) for t in [*first, *second]):
        raise ValueError("text_1 and text_2 must be strings or lists of strings.")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise ValueError(f"text_1 and text_2 must have the same length, or text_1 one item; "
                         f"got {len(first)} and {len(second)}.")
    return list(zip(first, second))


def check_cross_encoder(model_config: ModelConfig) -> None:
    """Raises ``ValueError`` unless a classifier may score pairs: it must have one label, as
    vLLM's score API requires."""
    num_labels = getattr(model_config.hf_config, "num_labels", 0)
    if model_config.is_classifier and num_labels != 1:
        raise ValueError(f"Scoring needs a model with one label (num_labels == 1); "
                         f"{model_config.model} has {num_labels}.")


def cross_encoder_prompt(tokenizer: Any, text_1: str, text_2: str, truncate_prompt_tokens: Optional[int],
                         max_model_len: int) -> dict:
    """The pair as one prompt: the tokenizer's pair encoding (special tokens and, when the
    tokenizer gives them, ``token_type_ids``: 1 on the second segment), cut by the tokenizer
    (longest segment first) to ``truncate_prompt_tokens`` (-1: ``max_model_len``; None: not cut)."""
    kwargs: dict[str, Any] = {}
    if truncate_prompt_tokens is not None:
        kwargs = {"truncation": True, "max_length": max_model_len if truncate_prompt_tokens == -1
                  else truncate_prompt_tokens}
    encoding = tokenizer(text_1, text_2, add_special_tokens=True, **kwargs)
    prompt = {"prompt_token_ids": list(encoding["input_ids"])}
    if encoding.get("token_type_ids") is not None:
        prompt["token_type_ids"] = list(encoding["token_type_ids"])
    return prompt


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of the angle between two vectors (0.0 when either is zero).

    Raises:
        ValueError: vectors of different lengths.
    """
    if len(a) != len(b):
        raise ValueError(f"Cannot compare embeddings of {len(a)} and {len(b)} values.")
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norms if norms > 0 else 0.0
