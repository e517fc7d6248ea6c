"""``PoolingParams``: per-request settings of a pooling (embedding) request, vLLM's names.

The engine returns each prompt's raw pooled vector (``pagedllm.model_executor.layers.pooler``);
``apply`` then cuts it to ``dimensions`` (Matryoshka models only) and L2-normalizes it, in
that order (vLLM's embedding head).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import msgspec

#: Pooling tasks built here (vLLM's ``PoolingTask`` names).
POOLING_TASKS = ("embed",)


class PoolingParams(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
):
    """Settings of one pooling request.

    ``task``: "embed". ``dimensions``: keep the first ``dimensions`` values (a Matryoshka
    model's shorter embedding; None: all). ``normalize``: L2-normalize the (cut) vector
    (None: the model's ``PoolerConfig.normalize``). ``truncate_prompt_tokens``: keep the last
    k prompt tokens (-1: the last ``max_model_len``; None: all).
    """

    task: str = "embed"
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None

    def verify(self, model_config: Any) -> PoolingParams:
        """These params checked against the model (a ``pagedllm.config.ModelConfig``: this
        plain-data module imports no config), with ``normalize`` resolved.

        Raises:
            ValueError: an unknown ``task``; ``dimensions`` for a model that is not
                Matryoshka, outside 1 .. hidden size, or not one of its
                ``matryoshka_dimensions``; ``truncate_prompt_tokens`` not -1 or in 1 .. max_model_len.
        """
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}.")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (truncate < -1 or truncate == 0 or truncate > model_config.max_model_len):
            raise ValueError(f"truncate_prompt_tokens must be -1 or in 1 .. {model_config.max_model_len} "
                             f"(max_model_len), got {truncate}.")
        if self.dimensions is not None:
            _check_dimensions(self.dimensions, model_config)
        normalize = self.normalize
        if normalize is None:
            pooler = model_config.pooler_config
            normalize = True if pooler is None or pooler.normalize is None else pooler.normalize
        return msgspec.structs.replace(self, normalize=normalize)

    def apply(self, pooled: list[float]) -> list[float]:
        """``pooled`` cut to ``dimensions`` and, with ``normalize``, divided by its L2 norm
        (a zero vector stays zero)."""
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
