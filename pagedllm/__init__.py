"""pagedllm: a high-throughput, memory-efficient LLM inference and serving engine.

The public names are imported on first use (PEP 562), so ``import pagedllm`` and the
``pagedllm`` command stay light until torch is needed (``pagedllm --help``, the client
commands; ``pagedllm serve`` imports torch once and forks its engine process after).
Importing it sets the few environment defaults of ``pagedllm.env_override`` (for torch,
which reads them when first used).
"""

from __future__ import annotations

import importlib
from typing import Any

from pagedllm import env_override
from pagedllm.logger import configure_logging
from pagedllm.version import __version__

env_override.apply()
configure_logging()

_LAZY = {
    "LLM": "pagedllm.entrypoints.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "SamplingParams": "pagedllm.sampling_params",
    "RequestOutputKind": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
