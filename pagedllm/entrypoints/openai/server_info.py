"""``GET /server_info``: what a client needs to start this server again (``pagedllm snapshot
create NAME --url URL``): the ``pagedllm serve`` flags it was started with, the folder they
are relative to, and the LoRA adapters it serves now (``--lora-modules`` and those loaded at
run time, less those unloaded).

The route is behind ``--api-key`` as every other. The flags it reports hold no key: the
``--api-key`` values are left out (``api_key`` says whether the server needs one), and
``--config FILE`` is replaced by the flags the file sets (``arg_parsing.inline_config_file``).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

from pagedllm.entrypoints.arg_parsing import drop_flag, inline_config_file
from pagedllm.version import __version__

if TYPE_CHECKING:  # FastAPI and pydantic: `pagedllm serve` calls reported_serve_args before it forks the engine
    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels

API_KEY_FLAG = "--api-key"
LORA_MODULES_FLAG = "--lora-modules"


def reported_serve_args(parser: argparse.ArgumentParser, serve_args: Sequence[str]) -> list[str]:
    """``serve_args`` (``parser``: ``pagedllm serve``'s, ``cli_args.serve_parser``) as
    ``/server_info`` reports them: the config file inlined, no API key."""
    return drop_flag(parser, inline_config_file(parser, serve_args), API_KEY_FLAG)


def server_info(reported_args: Optional[list[str]], models: OpenAIServingModels, needs_api_key: bool) -> dict[str, Any]:
    """The body of ``GET /server_info``; ``reported_args``: ``reported_serve_args`` of the
    server's flags, made once at start-up by ``cli_args.main`` (None when the app was not
    started by ``pagedllm serve``: one built in process).

    Returns:
        ``{"version", "cwd", "serve_args", "api_key"`` (bool), ``"lora_modules"``
        (``[{"name", "path", "base_model_name"}]``, in the order they were added)``}``.
    """
    return {
        "version": __version__,
        "cwd": os.getcwd(),
        "serve_args": reported_args,
        "api_key": needs_api_key,
        "lora_modules": [
            {"name": name, "path": request.lora_path, "base_model_name": request.base_model_name}
            for name, request in models.lora_requests.items()
        ],
    }
