"""How pagedllm starts its child processes (the engine core, the executor's workers): by
``fork`` or ``spawn`` (``multiprocessing`` start methods), as vLLM does.

``PAGEDLLM_WORKER_MULTIPROC_METHOD`` (or vLLM's ``VLLM_WORKER_MULTIPROC_METHOD``; ours wins
when both are set) is ``fork`` (the default where the OS has it, Linux) or ``spawn``. A
forked child starts at once and does not import the caller's script again, so a script
without an ``if __name__ == "__main__":`` guard can start workers (a spawned child runs the
script's top level again, and fails in multiprocessing's bootstrapping check). Fork is
still not used where it is unsafe; then the child is spawned, with a warning:

- CUDA is initialised in this process (a CUDA context does not survive ``fork``);
- ``torch.distributed`` is initialised in this process (the child would inherit its
  process group and take it for its own).

What a forked child inherits and must not use, and how each is dealt with (``start``):

- The OpenMP thread pool of the forking thread, without its threads (only the forking
  thread exists in the child). GNU libgomp keeps one pool per thread that ran a parallel
  region and does not reset it at fork: the child's first parallel region with more than
  one thread would wait for the missing threads for ever (a forward pass in the parent, as
  a second ``LLM`` in a script, is enough). So that pool is released just before the fork
  (``release_openmp_threads``); the parent's next parallel region starts a new one.
- The parent's ZeroMQ context and sockets: never touched by the child (each child makes
  its own context; pyzmq does not close a context or socket of another pid).
- Pipe ends the child does not own: closed in it (``close_in_child``), so a worker still
  sees its pipe close when the parent dies.
- The parent's signal wakeup fd (an asyncio loop's): reset by ``follow_parent_on_signals``.
- Files the parent registered with ``close_in_forked_children`` (the server's listening
  socket: a child holding it would keep the port open, accepting connections nobody
  answers, after the server closed it): closed in every forked child.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import sys
from multiprocessing.context import BaseContext
from typing import Any, Optional

from pagedllm import envs

logger = logging.getLogger(__name__)

#: The start method of pagedllm's child processes, ``fork`` or ``spawn`` (vLLM's name second).
WORKER_MULTIPROC_METHOD_ENV = envs.PAGEDLLM_WORKER_MULTIPROC_METHOD.names
START_METHODS = envs.PAGEDLLM_WORKER_MULTIPROC_METHOD.choices


def requested_method() -> str:
    """The start method the environment asks for (``WORKER_MULTIPROC_METHOD_ENV``, first
    set wins), else ``fork`` where this OS has it, else ``spawn``.

    Raises:
        ValueError: a value other than ``fork`` or ``spawn``.
    """
    method = envs.PAGEDLLM_WORKER_MULTIPROC_METHOD.get()
    if method is not None:
        return method
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def fork_unsafe_reason() -> Optional[str]:
    """Why this process must not fork now (see the module docstring), or None. Does not
    import torch: a process that has not imported it has initialised neither."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "torch.distributed is initialised in this process"
    return None


def get_mp_context() -> BaseContext:
    """The ``multiprocessing`` context to start a child with: ``requested_method()``, but
    ``spawn`` (and a warning) where ``fork_unsafe_reason()`` gives a reason.

    Raises:
        ValueError: as ``requested_method``.
    """
    method = requested_method()
    if method == "fork":
        reason = fork_unsafe_reason()
        if reason is not None:
            logger.warning(
                "%s: starting child processes with spawn instead of fork; a script must then keep its "
                "top-level code under `if __name__ == \"__main__\":`. Set %s=spawn to silence this.",
                reason, WORKER_MULTIPROC_METHOD_ENV[0],
            )
            method = "spawn"
    return multiprocessing.get_context(method)


#: Sonames of the OpenMP runtimes torch may run on (GNU, Intel, LLVM).
_OPENMP_RUNTIMES = ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.so.5")
_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2


def release_openmp_threads() -> None:
    """Stop this thread's OpenMP thread pool in each OpenMP runtime loaded in this process
    (``omp_pause_resource_all(omp_pause_hard)``, OpenMP 5.0; none loaded: nothing to do).
    Call it outside any parallel region."""
    for soname in _OPENMP_RUNTIMES:
        try:
            runtime = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
        except OSError:  # not loaded
            continue
        pause = getattr(runtime, "omp_pause_resource_all", None)
        if pause is not None:
            pause(_OMP_PAUSE_HARD)


def start(context: BaseContext, process: Any) -> None:
    """Start ``process`` (a ``context.Process``); for fork after ``release_openmp_threads``,
    with this process's objects frozen (``gc.freeze``) across the fork.

    NOTE: the child's garbage collector then never scans what it inherited (with torch and
    transformers loaded, millions of objects: a full collection while the engine builds its
    block pool took most of a second), and does not write to those pages (copy on write).
    This process unfreezes them again unless some were frozen before.
    """
    if context.get_start_method() != "fork":
        process.start()
        return
    release_openmp_threads()
    unfreeze = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        process.start()
    finally:
        if unfreeze:
            gc.unfreeze()


_close_after_fork: list = []


def close_in_forked_children(file: Any) -> None:
    """Close ``file`` (anything with ``close()``: a socket) in every process this one forks
    from now on, right after the fork (``os.register_at_fork``); this process keeps it."""
    if not _close_after_fork:
        os.register_at_fork(after_in_child=_close_registered)
    _close_after_fork.append(file)


def _close_registered() -> None:
    for file in _close_after_fork:
        file.close()


def close_in_child(context: BaseContext, connections: list) -> list:
    """What a child started with ``context`` should close first: ``connections`` (pipe ends
    of this process that a forked child inherits), or nothing for a spawned child, which
    inherits no file descriptors."""
    return list(connections) if context.get_start_method() == "fork" else []
