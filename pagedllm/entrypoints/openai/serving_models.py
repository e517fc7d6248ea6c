"""The served model names (``--served-model-name``) and ``GET /v1/models``."""

from __future__ import annotations

import time
from typing import Optional, Sequence

from pagedllm.entrypoints.openai.errors import model_not_found
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList


class OpenAIServingModels:
    """The names a client may use for the one model this server runs.

    Args:
        served_model_names: the aliases, first one reported by default (non-empty).
        model_path: where the weights are (reported as ``root``).
        max_model_len: the context length in tokens (reported as ``max_model_len``).
    """

    def __init__(self, served_model_names: Sequence[str], model_path: str, max_model_len: int) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model.")
        self.served_model_names = list(dict.fromkeys(served_model_names))
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.created = int(time.time())

    @property
    def base_model_name(self) -> str:
        return self.served_model_names[0]

    def resolve(self, model: Optional[str]) -> str:
        """The name to report for a request's ``model`` (None: the first served name).

        Raises:
            OpenAIServingError: 404 when ``model`` is not served here.
        """
        if model is None or model == "":
            return self.base_model_name
        if model not in self.served_model_names:
            raise model_not_found(model)
        return model

    def card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, root=self.model_path, max_model_len=self.max_model_len)

    def list_models(self) -> ModelList:
        """``GET /v1/models``: one card per served name."""
        return ModelList(data=[self.card(name) for name in self.served_model_names])

    def show_model(self, model_id: str) -> ModelCard:
        """``GET /v1/models/{id}``.

        Raises:
            OpenAIServingError: 404 for an unknown id.
        """
        return self.card(self.resolve(model_id if model_id else "\0"))
