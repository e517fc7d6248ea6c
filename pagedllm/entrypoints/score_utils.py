"""Text pairs for scoring, shared by ``LLM.score`` and ``/v1/score`` / ``/v1/rerank`` (vLLM's
``score_utils``): how two text inputs pair up, a cross-encoder's pair prompt, the cosine of
two embeddings.

A sequence classifier (``ModelConfig.is_classifier``) scores a pair as one input; an
embedding model embeds both texts and scores their cosine similarity (a bi-encoder), as
vLLM's score API. A classifier's pair input is, as vLLM builds it (``score_prompts``):

- with a score template (the server's ``--chat-template``, ``LLM.score``'s ``chat_template``):
  the template rendered over ``messages`` [{"role": "query", "content": text_1}, {"role":
  "document", "content": text_2}], tokenized as one text (Qwen3-Reranker's prompt);
- else, for a cross-encoder (``use_pad_token``, ``uses_pair_encoding``): the tokenizer's
  pair encoding, with BERT's token types;
- else (a causal LM made a classifier by ``classifier_from_token``, "an LLM as reranker"):
  text_1 + text_2 tokenized as one text (the caller's own prefix and suffix make the prompt).
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


def cross_encoder_prompt(tokenizer: Any, text_1: str, text_2: Optional[str] = None, *,
                         truncate_prompt_tokens: Optional[int], max_model_len: int) -> dict:
    """The pair as one prompt: the tokenizer's pair encoding (special tokens and, when the
    tokenizer gives them, ``token_type_ids``: 1 on the second segment; ``text_2`` None: of
    ``text_1`` alone), cut by the tokenizer (longest segment first) to ``truncate_prompt_tokens``
    (-1: ``max_model_len``; None: not cut)."""
    kwargs: dict[str, Any] = {}
    if truncate_prompt_tokens is not None:
        kwargs = {"truncation": True, "max_length": max_model_len if truncate_prompt_tokens == -1
                  else truncate_prompt_tokens}
    encoding = tokenizer(text_1, text_2, add_special_tokens=True, **kwargs)
    prompt = {"prompt_token_ids": list(encoding["input_ids"])}
    if encoding.get("token_type_ids") is not None:
        prompt["token_type_ids"] = list(encoding["token_type_ids"])
    return prompt


def uses_pair_encoding(hf_config: Any) -> bool:
    """Whether a classifier's pair is the tokenizer's pair encoding (vLLM's ``use_pad_token``,
    from config.json or ``--hf-overrides``): by default True, False for a classifier made from
    a causal LM's tokens (``classifier_from_token``), whose two texts are joined instead."""
    value = getattr(hf_config, "use_pad_token", None)
    if value is None:
        return getattr(hf_config, "classifier_from_token", None) is None
    return bool(value)


def score_template_text(tokenizer: Any, score_template: str, text_1: str, text_2: str) -> str:
    """``score_template`` (Jinja, a chat template's syntax) rendered over the messages
    [query text_1, document text_2] (module docstring).

    Raises:
        jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError: the template failed.
    """
    messages = [{"role": "query", "content": text_1}, {"role": "document", "content": text_2}]
    return tokenizer.apply_chat_template(messages, chat_template=score_template, tokenize=False)


def score_prompts(model_config: ModelConfig, tokenizer: Any, pairs: Sequence[tuple[str, str]],
                  truncate_prompt_tokens: Optional[int], score_template: Optional[str] = None) -> list[dict]:
    """A classifier's input of each pair (module docstring), cut as ``cross_encoder_prompt``."""
    pair_encoding = uses_pair_encoding(model_config.hf_config)
    prompts = []
    for text_1, text_2 in pairs:
        if score_template is not None:
            texts: tuple[str, ...] = (score_template_text(tokenizer, score_template, text_1, text_2),)
        else:
            texts = (text_1, text_2) if pair_encoding else (text_1 + text_2,)
        prompts.append(cross_encoder_prompt(tokenizer, *texts, truncate_prompt_tokens=truncate_prompt_tokens,
                                            max_model_len=model_config.max_model_len))
    return prompts


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of the angle between two vectors (0.0 when either is zero).

    Raises:
        ValueError: vectors of different lengths.
    """
    if len(a) != len(b):
        raise ValueError(f"Cannot compare embeddings of {len(a)} and {len(b)} values.")
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norms if norms > 0 else 0.0
