"""The loader's side of preloaded weights (``--load-format ipc_cache``, and ``auto``).

``load_preloaded`` finds this rank's store of the model under ``PAGEDLLM_PRELOAD_DIR``
(``key.store_name``), compares its key with this engine's (``key.cache_key``) and maps it
(``store.map_store``). With ``ipc_cache`` a missing or mismatched store is an error naming the
field; with ``auto`` a mismatch is a warning and the checkpoint is loaded as usual.

``recorded_activation_peak`` / ``record_activation_peak``: the activation peak that the first
engine mapping a store measured (its profiling run), kept beside the store
(``store.PROFILE_FILE``) with what the run depended on, so that the next ``ipc_cache`` engines
of the same settings skip the profiling run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from pagedllm import envs
from pagedllm.preload.key import cache_key, mismatch, store_name
from pagedllm.preload.store import KEY_FILE, PROFILE_FILE, map_store, read_key

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
    directory = _store_dir(model_config, wanted)
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


def _store_dir(model_config: Any, key: Optional[dict[str, Any]] = None) -> Path:
    """This rank's store folder of ``model_config`` (``key``: its ``cache_key``, computed when None)."""
    key = cache_key(model_config) if key is None else key
    return preload_root() / store_name(model_config.model_path, key["tensor_parallel_rank"],
                                       key["pipeline_parallel_rank"])


def recorded_activation_peak(model_config: Any, inputs: dict[str, Any]) -> Optional[int]:
    """The activation peak (bytes) recorded beside this rank's store of ``model_config`` by an
    engine whose profiling run had the same ``inputs`` (JSON values: the settings the run
    depends on), or None (none recorded, other inputs, an unreadable file)."""
    try:
        recorded = json.loads((_store_dir(model_config) / PROFILE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if recorded.get("inputs") != json.loads(json.dumps(inputs)):
        return None
    return int(recorded["activation_peak"])


def record_activation_peak(model_config: Any, inputs: dict[str, Any], activation_peak: int) -> None:
    """Keep ``activation_peak`` (bytes, measured with ``inputs``) beside this rank's store
    (replacing one there; best effort: a store folder that cannot be written is skipped)."""
    directory = _store_dir(model_config)
    staging = directory / f".{PROFILE_FILE}.{os.getpid()}"
    try:
        staging.write_text(json.dumps({"inputs": inputs, "activation_peak": int(activation_peak)}))
        os.replace(staging, directory / PROFILE_FILE)
    except OSError as exc:
        logger.info("Could not record the activation peak beside the store %s: %s", directory, exc)
