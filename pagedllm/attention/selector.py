"""Which attention backend runs: a registry by name, and the choice.

The choice, made once per engine (``get_attn_backend``): the name given
(``--attention-backend``), else ``$PAGEDLLM_ATTENTION_BACKEND``, else automatic — the first
backend of ``current_platform.attn_backend_preference`` that can run with the model's head
size and dtype, the block size, and the attention features the model uses (sliding windows,
logits soft caps, sinks, chunked local attention, bidirectional image spans; on CPU:
``CPU_ATTN`` when the C++ kernels build, else ``TORCH_SDPA``; both have every feature); when it
passes over a backend it logs why (INFO,
once per reason). A model with multi-head latent attention (``use_mla``: DeepSeek-V2 / V3)
runs on an MLA backend (``AttentionBackend.is_mla``; built: ``TORCH_MLA``), any other on a
backend that is not one. Another backend (a CUDA one, a test's) joins with
``register_attn_backend`` and is then chosen by name.

``Attention`` layers are built inside ``set_attn_backend(backend)`` (``get_model``'s
``attn_backend``, which the model runner chooses) and hold that backend's impl; one built
outside it is an error.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch

from pagedllm import envs
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.backends.cpu_attn import CpuAttnBackend
from pagedllm.attention.backends.torch_mla import TorchMLABackend
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.platforms import current_platform

#: Environment variable naming the backend when ``--attention-backend`` is not given.
ENV = envs.PAGEDLLM_ATTENTION_BACKEND.name

logger = logging.getLogger(__name__)

_registry: dict[str, type[AttentionBackend]] = {}
_model_backend: Optional[type[AttentionBackend]] = None
_logged_choices: set[str] = set()


def register_attn_backend(backend: type[AttentionBackend]) -> type[AttentionBackend]:
    """Make ``backend`` selectable by its ``get_name()`` (replacing one of the same name);
    returns it, so it can decorate the class."""
    _registry[backend.get_name().upper()] = backend
    return backend


def registered_attn_backends() -> list[str]:
    """The names of the registered backends."""
    return list(_registry)


def get_attn_backend(
    head_size: int, dtype: torch.dtype, block_size: Optional[int], name: Optional[str] = None,
    kv_cache_dtype: str = "auto", uses_sliding_window: bool = False, uses_logits_soft_cap: bool = False,
    has_sinks: bool = False, use_mla: bool = False, uses_bidirectional_ranges: bool = False,
    uses_chunked_local_attention: bool = False,
) -> type[AttentionBackend]:
    """The backend to run: ``name`` (case-insensitive), else ``$PAGEDLLM_ATTENTION_BACKEND``,
    else the platform's first that can run.

    Args:
        head_size: channels per attention head; dtype: the model's compute dtype;
        block_size: tokens per KV-cache block (None: not checked).
        name: a registered backend's name, or None.
        kv_cache_dtype: ``--kv-cache-dtype`` ("auto" or an FP8 type).
        uses_sliding_window: some layer of the model has a sliding window (a backend must
            support windows, ``AttentionBackend.supports_sliding_window``);
        uses_logits_soft_cap, has_sinks: likewise, a logits soft cap, attention sinks
            (``supports_logits_soft_cap``, ``supports_sinks``), attention both ways inside
            images' tokens (``supports_bidirectional_ranges``), chunked local attention
            (``supports_chunked_local_attention``).
        use_mla: the model's attention is MLA: only MLA backends qualify (automatic: the
            registered ones, in order); else only the others.

    Raises:
        ValueError: an unknown name (the message lists the registered ones), a named backend
            that cannot run here, or (automatic) none that can — each with the reasons.
    """
    name = name or envs.PAGEDLLM_ATTENTION_BACKEND.get()
    features = (uses_sliding_window, uses_logits_soft_cap, has_sinks, uses_bidirectional_ranges,
                uses_chunked_local_attention)
    if name is not None:
        backend = _registry.get(name.upper())
        if backend is None:
            raise ValueError(
                f"Unknown attention backend {name!r}; registered backends: {', '.join(_registry)}."
            )
        reasons = backend.validate_configuration(head_size, dtype, block_size, kv_cache_dtype, *features)
        if backend.is_mla() != use_mla:
            reasons.append("the model's attention is MLA" if use_mla else "it runs MLA only, which the model does not use")
        if reasons:
            raise ValueError(f"Attention backend {backend.get_name()} cannot run here: {'; '.join(reasons)}.")
        return backend
    rejected = []
    preference = [n for n, b in _registry.items() if b.is_mla()] if use_mla else current_platform.attn_backend_preference
    for candidate in preference:
        backend = _registry.get(candidate)
        if backend is None:  # registered later, if at all (e.g. a CUDA backend)
            continue
        reasons = backend.validate_configuration(head_size, dtype, block_size, kv_cache_dtype, *features)
        if not reasons:
            if rejected:
                _log_once(f"Attention backend {candidate} chosen over {' | '.join(rejected)}.")
            return backend
        rejected.append(f"{candidate}: {'; '.join(reasons)}")
    raise ValueError(f"No attention backend can run here ({' | '.join(rejected)}).")


def _log_once(message: str) -> None:
    if message not in _logged_choices:
        _logged_choices.add(message)
        logger.info(message)


@contextlib.contextmanager
def set_attn_backend(backend: type[AttentionBackend]) -> Iterator[None]:
    """``Attention`` layers constructed inside the block use ``backend``."""
    global _model_backend
    previous, _model_backend = _model_backend, backend
    try:
        yield
    finally:
        _model_backend = previous


def get_current_attn_backend(
    uses_sliding_window: bool = False, uses_logits_soft_cap: bool = False, has_sinks: bool = False,
    uses_chunked_local_attention: bool = False,
) -> type[AttentionBackend]:
    """The backend of the ``set_attn_backend`` block an ``Attention`` layer is being
    constructed in.

    Raises:
        RuntimeError: outside any ``set_attn_backend`` block (build models with
            ``get_model(..., attn_backend)``).
        ValueError: the layer has a sliding window, a logits soft cap or sinks, and the
            backend lacks it.
    """
    if _model_backend is None:
        raise RuntimeError(
            "No attention backend set: build models inside selector.set_attn_backend(backend) "
            "(model_loader.get_model(model_config, device, attn_backend) does)."
        )
    missing = _model_backend.missing_features(uses_sliding_window, uses_logits_soft_cap, has_sinks,
                                              uses_chunked_local_attention=uses_chunked_local_attention)
    if missing:
        raise ValueError(
            f"Attention backend {_model_backend.get_name()} has no {', '.join(missing)}, which this layer uses."
        )
    return _model_backend


for _builtin in (CpuAttnBackend, TorchSDPABackend, TorchMLABackend):
    register_attn_backend(_builtin)
