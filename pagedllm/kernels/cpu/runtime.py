"""Which build of the C++ CPU kernels this process runs, decided once.

The level is ``pagedllm.kernels.isa.selected_isa()``, or the next lower one that builds
(``build.load``); none, or ``PAGEDLLM_DISABLE_CPU_KERNELS`` set, means unavailable (one
message says why) and callers use their portable PyTorch code. ``namespace()`` is the active
build's ``torch.ops`` namespace; callables bound from it are told to drop it
(``on_change``) whenever the choice may change (``reread_env``, ``using_isa``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

import torch

from pagedllm import envs
from pagedllm.kernels import isa as isa_mod
from pagedllm.kernels.cpu import build

logger = logging.getLogger(__package__)

DISABLE_ENV = envs.PAGEDLLM_DISABLE_CPU_KERNELS.name

_lock = threading.Lock()
_builds: dict[str, str | None] = {}  # level -> None (loaded) or why it could not be built
_active: str | None = None  # the level whose operators run
_error: str | None = None  # why no level could be loaded, once a load was tried
_disabled: bool | None = None  # DISABLE_ENV as last read (None: not yet)
_disabled_logged = False
_listeners: list[Callable[[], None]] = []


def _disabled_by_env() -> bool:
    return envs.PAGEDLLM_DISABLE_CPU_KERNELS.get()


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback()`` whenever the active build may change: after ``reread_env`` and on
    entering and leaving ``using_isa``."""
    _listeners.append(callback)


def _changed() -> None:
    for callback in _listeners:
        callback()


def reread_env() -> None:
    """Have the next ``is_available()`` read ``PAGEDLLM_DISABLE_CPU_KERNELS`` again (it is
    read once per process otherwise): for tests that set or clear it at run time. Builds
    already loaded stay loaded; layers built afterwards see the new answer."""
    global _disabled, _disabled_logged
    _disabled = None
    _disabled_logged = False
    _changed()


def _ensure_built(level: str) -> bool:
    """Build or load ``level`` once (call under ``_lock``); whether it is loaded."""
    if level not in _builds:
        _builds[level] = build.load(level)
    return _builds[level] is None


def is_available() -> bool:
    """Whether the C++ CPU kernels can be used; builds/loads them on the first call, at the
    level ``pagedllm.kernels.isa.selected_isa()`` names (or the next lower one that builds),
    and logs the level with the CPU's own.

    Returns False (after logging one message with the reason) when
    ``PAGEDLLM_DISABLE_CPU_KERNELS`` is set (as read by the first call, or the first after
    ``reread_env()``) or no level can be built or loaded.

    Raises:
        ValueError: ``PAGEDLLM_CPU_ISA`` names an unknown level or one above this CPU's.
    """
    global _active, _error, _disabled, _disabled_logged
    if _active is not None and _disabled is False:
        return True
    if _disabled is None:
        _disabled = _disabled_by_env()
    if _disabled:
        if not _disabled_logged:
            _disabled_logged = True
            logger.info("pagedllm C++ CPU kernels disabled by %s: portable PyTorch code", DISABLE_ENV)
        return False
    if _active is not None:
        return True
    if _error is not None:
        return False
    with _lock:
        if _active is not None or _error is not None:
            return _active is not None
        selected = isa_mod.selected_isa()
        for level in reversed(isa_mod.LEVELS[: isa_mod.LEVELS.index(selected) + 1]):
            if _ensure_built(level):
                _active = level
                override = envs.PAGEDLLM_CPU_ISA.get()
                logger.info(
                    "pagedllm CPU kernels: %s (this CPU supports up to %s%s)",
                    level,
                    isa_mod.detected_isa(),
                    f"; {isa_mod.ENV}={override}" if override else "",
                )
                return True
        _error = "; ".join(reason for reason in _builds.values() if reason)
        logger.warning(
            "pagedllm C++ CPU kernels unavailable, using the portable PyTorch code (slower). Reason: %s", _error
        )
    return False


def namespace() -> Any:
    """``torch.ops.pagedllm_cpu_<level>`` of the active build.

    Raises:
        RuntimeError: if the kernels are unavailable (with the reason).
    """
    if not is_available():
        reason = "disabled by " + DISABLE_ENV if _disabled else _error
        raise RuntimeError(f"pagedllm C++ CPU kernels unavailable: {reason}")
    return getattr(torch.ops, f"pagedllm_cpu_{_active}")


def active_isa() -> str:
    """The instruction-set level the kernels run at (see ``is_available``).

    Raises:
        RuntimeError: if the kernels are unavailable.
    """
    namespace()
    assert _active is not None
    return _active


@contextlib.contextmanager
def using_isa(level: str) -> Iterator[None]:
    """Run the kernels of ``level`` (building it if needed) inside the block, then return to
    the process's level. For tests and benchmarks that compare the paths one host supports;
    not thread-safe against kernels running elsewhere in the process.

    Raises:
        RuntimeError: if the kernels are unavailable, or ``level`` cannot be built.
        ValueError: if ``level`` is unknown or above this CPU's.
    """
    global _active
    if isa_mod.parse_override(level) is None:
        raise ValueError(f"no instruction-set level given: {level!r}")
    namespace()
    with _lock:
        if not _ensure_built(level):
            raise RuntimeError(f"pagedllm CPU kernels for {level} cannot be built: {_builds[level]}")
        previous, _active = _active, level
    _changed()
    try:
        yield
    finally:
        _active = previous
        _changed()


def build_info() -> str:
    """The instruction-set level the running build was compiled for, and OpenMP, e.g.
    ``"avx2,openmp"``.

    Raises:
        RuntimeError: if the kernels are unavailable.
    """
    return namespace().build_info()


def has_packed_linear() -> bool:
    """Whether ``packed_linear`` can run here: the kernels available at the avx512_bf16 level."""
    return is_available() and build_info().startswith("avx512_bf16")


def has_amx() -> bool:
    """Whether ``packed_linear(..., amx=True)`` can run here: ``has_packed_linear()``, and the
    CPU has AMX-TILE and AMX-BF16 and the OS grants their state (Linux 5.16+; asked once)."""
    return has_packed_linear() and bool(namespace().has_amx())
