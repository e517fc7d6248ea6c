"""The loader's side of preloaded weights (``--load-format ipc_cache``, and ``auto``).

``load_preloaded`` finds this rank's store of the model under ``PAGEDLLM_PRELOAD_DIR``
(``key.store_name``), compares its key with this engine's (``key.cache_key``) and maps it
(``store.map_store``). With ``ipc_cache`` a missing or mismatched store is an error naming the
field; with ``auto`` a mismatch is a warning and the checkpoint is loaded as usual.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from pagedllm import envs
from pagedllm.preload.key import cache_key, mismatch, store_name
from pagedllm.preload.store import KEY_FILE, map_store, read_key

logger = logging.getLogger(__name__)


def preload_root() -> Path:
    """The folder of the stores and the daemon's control socket (``PAGEDLLM_PRELOAD_DIR``)."""
    return Path(envs.PAGEDLLM_PRELOAD_DIR.get())


def load_preloaded(model_config: Any, required: bool,
                   pack_opaque: Callable[[torch.Tensor], torch.Tensor]) -> Optional[nn.Module]:
    """The preloaded model of ``model_config`` for this rank, mapped (``pack_opaque``: see
    ``store.map_store``); None (``required`` False) when there is none or it does not match,
    with a warning for a mismatch.

    Raises:
        ValueError: ``required`` and no store, or a key that differs (naming the field).
    """
    wanted = cache_key(model_config)
    directory = preload_root() / store_name(model_config.model_path, wanted["tensor_parallel_rank"],
                                            wanted["pipeline_parallel_rank"])
    if not (directory / KEY_FILE).exists():
        if required:
            raise ValueError(
                f"--load-format ipc_cache: no preloaded weights of {wanted['model_path']} in {preload_root()}; "
                f"start `pagedllm preload {model_config.model}` (with this engine's flags) first."
            )
        return None
    problem = mismatch(read_key(directory)["key"], wanted)
    if problem is not None:
        if required:
            raise ValueError(f"--load-format ipc_cache: the preloaded weights of {wanted['model_path']} do not "
                             f"match this engine: {problem}.")
        logger.warning("Preloaded weights of %s do not match this engine (%s); loading the checkpoint.",
                       wanted["model_path"], problem)
        return None
    model = map_store(directory, pack_opaque)
    logger.info("Mapped the preloaded weights of %s from %s", wanted["model_path"], directory)
    return model
