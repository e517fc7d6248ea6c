"""Which ``Executor`` runs an engine's workers, chosen once when the ``EngineCore`` is built
(vLLM's ``Executor.get_class`` rule). The executors are imported only when chosen: Ray's is
costly to import, and each executor module imports ``abstract``, so the choice lives here.
"""

from __future__ import annotations

import importlib.util
import sys

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor
from pagedllm.platforms import current_platform

#: ``distributed_executor_backend`` names that vLLM has and pagedllm does not yet.
UNSUPPORTED_BACKENDS = ("external_launcher",)


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class for ``config.parallel_config.distributed_executor_backend``:
    an ``Executor`` subclass is used as given; ``"uni"`` (or None with a world size of
    1) is ``UniProcExecutor``; ``"ray"`` (or None with a world size above 1 in a process
    connected to Ray, or, on GPUs with Ray installed, above this machine's devices: vLLM's
    rule) is ``RayDistributedExecutor``; ``"mp"`` (or None with a
    world size above 1 otherwise, as vLLM on one machine) is ``MultiprocExecutor``.

    Raises:
        NotImplementedError: for ``"external_launcher"``.
        ValueError: ``"uni"`` with a world size above 1, or an unknown name.
        TypeError: for a class that is not an ``Executor``.
    """
    parallel_config = config.parallel_config
    backend = parallel_config.distributed_executor_backend
    if isinstance(backend, type):
        if not issubclass(backend, Executor):
            raise TypeError(f"distributed_executor_backend must be an Executor subclass, got {backend!r}.")
        return backend
    if backend in UNSUPPORTED_BACKENDS:
        raise NotImplementedError(
            f"distributed_executor_backend {backend!r} is not supported yet; use 'mp', 'ray' or 'uni'."
        )
    if backend not in (None, "uni", "mp", "ray"):
        raise ValueError(
            f"Unknown distributed_executor_backend {backend!r}; choose 'mp', 'ray', 'uni' (or None), or pass "
            f"an Executor subclass."
        )
    world_size = parallel_config.world_size
    if backend == "ray" or (backend is None and world_size > 1 and _ray_by_default(world_size)):
        from pagedllm.executor.ray_executor import RayDistributedExecutor

        return RayDistributedExecutor
    if backend == "uni" and world_size > 1:
        raise ValueError(
            f"distributed_executor_backend 'uni' runs one worker, but tensor_parallel_size "
            f"{parallel_config.tensor_parallel_size} x pipeline_parallel_size "
            f"{parallel_config.pipeline_parallel_size} = {world_size} workers are needed; use 'mp'."
        )
    if backend == "mp" or world_size > 1:
        from pagedllm.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    from pagedllm.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


def _ray_by_default(world_size: int) -> bool:
    """Whether ``world_size`` workers default to Ray: this process has joined a Ray cluster
    (``ray.init``; Ray is not imported to find out), or the platform sends workers beyond its
    devices to Ray (``Platform.ray_beyond_local_devices``), Ray is installed and this
    machine cannot host them."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return True
    if not current_platform.ray_beyond_local_devices or importlib.util.find_spec("ray") is None:
        return False
    try:
        current_platform.check_worker_count(world_size)
    except ValueError:
        return True
    return False
