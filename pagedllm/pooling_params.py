"""``PoolingParams``: per-request settings of a pooling request, vLLM's names.

The engine returns each prompt's raw pooled vector (``pagedllm.model_executor.layers.pooler``:
an embedding, or a classifier's logits); ``apply`` then, for "embed", cuts it to
``dimensions`` (Matryoshka models only) and L2-normalizes it, in that order (vLLM's
embedding head), and for "classify" / "score" applies the model's activation (sigmoid or
softmax, ``ModelConfig.pooling_activations``; vLLM's ``ClassifierPooler``).

A cross-encoder's second segment reaches the model as token type 1 inside the prompt's token
ids (``encode_token_type_ids``; vLLM packs them alike), so that the engine carries plain ids.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import msgspec

#: Pooling tasks built here (vLLM's ``PoolingTask`` names).
POOLING_TASKS = ("embed", "classify", "score")
#: Activations ``apply`` runs on a classifier's logits.
ACTIVATIONS = ("sigmoid", "softmax", "tanh", "identity")
#: Token type t of a prompt token is packed as ``token_id + (t << TOKEN_TYPE_SHIFT)``.
TOKEN_TYPE_SHIFT = 30


class PoolingParams(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
):
    """Settings of one pooling request.

    ``task``: "embed", "classify" or "score" (``POOLING_TASKS``). ``dimensions``: keep the
    first ``dimensions`` values (a Matryoshka model's shorter embedding; None: all).
    ``normalize``: L2-normalize the (cut) vector (None: the model's ``PoolerConfig.normalize``).
    ``truncate_prompt_tokens``: keep the last k prompt tokens (-1: the last ``max_model_len``;
    None: all). ``use_activation``: "classify" / "score" apply the model's activation to the
    logits (None: True; False: raw logits). ``activation_fn``: that activation
    (``ACTIVATIONS``), set by ``verify`` from the model, not by users.
    """

    task: str = "embed"
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None
    use_activation: Optional[bool] = None
    activation_fn: Optional[str] = None

    def verify(self, model_config: Any) -> PoolingParams:
        """These params checked against the model (a ``pagedllm.config.ModelConfig``: this
        plain-data module imports no config), with ``normalize`` resolved.

        Raises:
            ValueError: an unknown ``task``, or one the model does not serve
                (``ModelConfig.pooling_tasks``); ``dimensions`` for another task than "embed", a model
                that is not Matryoshka, outside 1 .. hidden size, or not one of its
                ``matryoshka_dimensions``; ``truncate_prompt_tokens`` not -1 or in 1 .. max_model_len.
        """
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}.")
        supported = model_config.pooling_tasks
        if self.task not in supported:
            raise ValueError(f"{model_config.model} does not serve the {self.task!r} pooling task; "
                             f"it serves {list(supported)}.")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (truncate < -1 or truncate == 0 or truncate > model_config.max_model_len):
            raise ValueError(f"truncate_prompt_tokens must be -1 or in 1 .. {model_config.max_model_len} "
                             f"(max_model_len), got {truncate}.")
        if self.dimensions is not None:
            if self.task != "embed":
                raise ValueError(f"dimensions applies to embeddings only, not to the {self.task!r} task.")
            _check_dimensions(self.dimensions, model_config)
        if self.task != "embed":
            use_activation = self.use_activation is not False
            return msgspec.structs.replace(self, use_activation=use_activation,
                                           activation_fn=model_config.pooling_activations[self.task])
        normalize = self.normalize
        if normalize is None:
            pooler = model_config.pooler_config
            normalize = True if pooler is None or pooler.normalize is None else pooler.normalize
        return msgspec.structs.replace(self, normalize=normalize)

    def apply(self, pooled: list[float]) -> list[float]:
        """For "embed": ``pooled`` cut to ``dimensions`` and, with ``normalize``, divided by its
        L2 norm (a zero vector stays zero). For "classify" / "score": the logits through
        ``activation_fn`` when ``use_activation`` (softmax over all of them; the others per value)."""
        if self.task != "embed":
            return activate(pooled, self.activation_fn) if self.use_activation else list(pooled)
        data = pooled[: self.dimensions] if self.dimensions is not None else list(pooled)
        if self.normalize:
            norm = math.sqrt(math.fsum(x * x for x in data))
            if norm > 0:
                data = [x / norm for x in data]
        return data


def _check_dimensions(dimensions: int, model_config: Any) -> None:
    """Raises ``ValueError`` unless the model may return ``dimensions`` values (see ``verify``)."""
    if not model_config.is_matryoshka:
        raise ValueError(
            f"dimensions is not supported by {model_config.model}: it is not a Matryoshka model "
            "(config.json sets neither is_matryoshka nor matryoshka_dimensions), so a cut embedding would be poor."
        )
    hidden = model_config.hf_config.hidden_size
    if not 1 <= dimensions <= hidden:
        raise ValueError(f"dimensions must be in 1 .. {hidden} (the embedding size), got {dimensions}.")
    allowed = model_config.matryoshka_dimensions
    if allowed and dimensions not in allowed:
        raise ValueError(f"dimensions must be one of {model_config.model}'s matryoshka_dimensions {allowed}, "
                         f"got {dimensions}.")


def activate(logits: list[float], activation_fn: Optional[str]) -> list[float]:
    """``logits`` through ``activation_fn`` (``ACTIVATIONS``; None: "identity"), in float64.

    Raises:
        ValueError: an unknown activation.
    """
    if activation_fn in (None, "identity"):
        return list(logits)
    if activation_fn == "sigmoid":
        return [1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x)) for x in logits]
    if activation_fn == "tanh":
        return [math.tanh(x) for x in logits]
    if activation_fn == "softmax":
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = math.fsum(exps)
        return [e / total for e in exps]
    raise ValueError(f"activation_fn must be one of {ACTIVATIONS}, got {activation_fn!r}.")


def encode_token_type_ids(token_ids: list[int], token_type_ids: list[int]) -> list[int]:
    """``token_ids`` with each token's type packed above ``TOKEN_TYPE_SHIFT`` (vLLM's packing
    of a cross-encoder's segments); the model unpacks them (``pagedllm.model_executor.models.bert``).

    Raises:
        ValueError: lists of different lengths, a type other than 0 or 1, or a token id of
            ``1 << TOKEN_TYPE_SHIFT`` or more.
    """
    if len(token_ids) != len(token_type_ids):
        raise ValueError(f"token_type_ids has {len(token_type_ids)} values for {len(token_ids)} tokens.")
    if any(t not in (0, 1) for t in token_type_ids):
        raise ValueError("token_type_ids must be 0 or 1.")
    if any(i >= 1 << TOKEN_TYPE_SHIFT for i in token_ids):
        raise ValueError(f"token ids must be below {1 << TOKEN_TYPE_SHIFT} to carry a token type.")
    return [i + (t << TOKEN_TYPE_SHIFT) for i, t in zip(token_ids, token_type_ids)]


def decode_token_ids(token_ids: list[int]) -> list[int]:
    """The token ids of ``encode_token_type_ids``' output, without their types."""
    return [i & ((1 << TOKEN_TYPE_SHIFT) - 1) for i in token_ids]
