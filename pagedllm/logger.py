"""The ``pagedllm`` logger: INFO to stderr by default, like vLLM's.

Level from the ``PAGEDLLM_LOGGING_LEVEL`` environment variable (e.g. WARNING to quieten).
"""

from __future__ import annotations

import logging

from pagedllm import envs

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def configure_logging() -> None:
    """Attach one stderr handler to the ``pagedllm`` logger (idempotent)."""
    logger = logging.getLogger("pagedllm")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(envs.PAGEDLLM_LOGGING_LEVEL.get().upper())
    logger.propagate = False
