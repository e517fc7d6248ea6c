"""The served model names (``--served-model-name``), the LoRA adapters served under their
own names (``--lora-modules``, ``/v1/load_lora_adapter``), and ``GET /v1/models``."""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Optional, Sequence

from pagedllm.entrypoints.openai.errors import OpenAIServingError, bad_request, model_not_found
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList
from pagedllm.lora.request import LoRARequest


class OpenAIServingModels:
    """The names a client may use: the one base model's aliases and the LoRA adapters.

    Args:
        served_model_names: the aliases, first one reported by default (non-empty).
        model_path: where the weights are (reported as ``root``).
        max_model_len: the context length in tokens (reported as ``max_model_len``).
        lora_modules: ``--lora-modules`` items (``{"name", "path", "base_model_name"}``).
        check_lora: checks an adapter and returns the request to send (the engine's
            ``Processor.check_lora``; raises ``FileNotFoundError`` / ``ValueError``).

    Raises:
        ValueError: no served name; a LoRA module that fails ``check_lora`` or repeats a name.
        FileNotFoundError: a LoRA module's path holds no adapter.
    """

    def __init__(
        self, served_model_names: Sequence[str], model_path: str, max_model_len: int,
        lora_modules: Sequence[dict[str, Any]] = (), check_lora: Optional[Callable[[LoRARequest], LoRARequest]] = None,
    ) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model.")
        self.served_model_names = list(dict.fromkeys(served_model_names))
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self.check_lora = check_lora
        #: adapter name -> its request (int ids from 1, never reused: a re-loaded name is new).
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        for module in lora_modules:
            self.add_lora(module["name"], module["path"], module.get("base_model_name"))

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
        if model not in self.served_model_names and model not in self.lora_requests:
            raise model_not_found(model)
        return model

    def lora_request(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's ``model`` names, or None (the base model)."""
        return self.lora_requests.get(model) if model else None

    def add_lora(self, name: str, path: str, base_model_name: Optional[str] = None) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name`` (checked by ``check_lora`` first).

        Raises:
            ValueError: the name is taken, or the adapter does not fit (the reason).
            FileNotFoundError: no adapter at ``path``.
        """
        if name in self.lora_requests or name in self.served_model_names:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        request = LoRARequest(name, next(self._lora_ids), path, base_model_name or self.base_model_name)
        if self.check_lora is None:
            raise ValueError("LoRA is not enabled (--enable-lora).")
        self.check_lora(request)
        self.lora_requests[name] = request
        return request

    def load_lora_adapter(self, body: dict[str, Any]) -> str:
        """``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` (vLLM's): the success text.

        Raises:
            OpenAIServingError: 400 for missing fields, a name already loaded or an adapter
                that does not fit the model; 404 when ``lora_path`` holds no adapter.
        """
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        try:
            self.add_lora(name, path)
        except FileNotFoundError as exc:
            raise OpenAIServingError(str(exc), 404, "NotFoundError", "lora_path") from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, body: dict[str, Any]) -> str:
        """``POST /v1/unload_lora_adapter {"lora_name"}`` (vLLM's): the success text. Requests
        already running with the adapter finish with it; new ones get a 404.

        Raises:
            OpenAIServingError: 400 without ``lora_name``; 404 for a name not loaded.
        """
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad_request("'lora_name' must be provided.")
        if self.lora_requests.pop(name, None) is None:
            raise OpenAIServingError(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError", "lora_name")
        return f"Success: LoRA adapter '{name}' removed successfully."

    def card(self, name: str) -> ModelCard:
        lora = self.lora_requests.get(name)
        if lora is not None:
            return ModelCard(id=name, created=self.created, root=lora.lora_path, parent=lora.base_model_name,
                             max_model_len=self.max_model_len)
        return ModelCard(id=name, created=self.created, root=self.model_path, max_model_len=self.max_model_len)

    def list_models(self) -> ModelList:
        """``GET /v1/models``: one card per served name, then one per LoRA adapter (``parent``:
        its base model, ``root``: its path; as vLLM)."""
        return ModelList(data=[self.card(name) for name in [*self.served_model_names, *self.lora_requests]])

    def show_model(self, model_id: str) -> ModelCard:
        """``GET /v1/models/{id}``.

        Raises:
            OpenAIServingError: 404 for an unknown (or empty) id.
        """
        if not model_id:
            raise model_not_found(model_id)
        return self.card(self.resolve(model_id))
