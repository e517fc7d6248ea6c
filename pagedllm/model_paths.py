"""Where the model that ships inside the pagedllm package lives.

``pagedllm serve`` with no MODEL and ``LLM()`` with no model use :func:`default_model_path`,
so the first run needs no download. The directory is in Hugging Face layout (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json,
README.md) and is package data (``pagedllm/assets/**``), so it is present in an editable
install and in a wheel alike. It is produced by ``tools/train_default_model.py``; its
README.md is the model card.
"""

from __future__ import annotations

import pathlib

DEFAULT_MODEL_NAME = "pagedllm-default"
"""Name of the shipped model; also the model id the server reports when serving it."""


def default_model_path() -> pathlib.Path:
    """Return the directory of the shipped model inside the installed package.

    The path is returned whether or not it exists; callers that need the files can check
    ``(default_model_path() / "config.json").is_file()``.
    """
    return pathlib.Path(__file__).resolve().parent / "assets" / DEFAULT_MODEL_NAME
