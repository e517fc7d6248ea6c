"""Which ``EngineCoreClient`` a front end gets (vLLM's ``EngineCoreClient.make_client``):
``LLMEngine`` a sync in-process one, ``AsyncLLM`` and ``pagedllm serve`` an async one, with
``data_parallel_size`` > 1 a ``DPAsyncMPClient``. Every client module stays below this one.
"""

from __future__ import annotations

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core_client import AsyncMPClient, EngineCoreClient, InprocClient, MPClient
from pagedllm.engine.dp_client import DPAsyncMPClient


def make_client(
    config: EngineConfig | EngineArgs, multiprocess: bool, asyncio_mode: bool, wait_for_ready: bool = True
) -> EngineCoreClient:
    """The client for a front end: ``LLMEngine`` asks for a sync in-process one
    (``InprocClient``), ``AsyncLLM`` for an async one. Async clients always run the core
    in the background (a process, or a thread when ``multiprocess`` is False); with
    ``data_parallel_size`` > 1, one process per replica behind a ``DPAsyncMPClient``.

    ``config`` may be ``EngineArgs`` and ``wait_for_ready`` False only for background
    clients (see ``core_client._BackgroundClient``); an ``InprocClient`` is ready when built.

    Raises:
        ValueError: bad settings (from the engine), as the client constructors.
        EngineStartupError: a background engine crashed while starting.
    """
    if asyncio_mode and _data_parallel_size(config) > 1:
        if not multiprocess:
            raise ValueError("Data-parallel engine replicas run in processes of their own (multiprocess=True).")
        return DPAsyncMPClient(config, wait_for_ready=wait_for_ready)
    if asyncio_mode:
        return AsyncMPClient(config, engine_in_thread=not multiprocess, wait_for_ready=wait_for_ready)
    if multiprocess:
        return MPClient(config, wait_for_ready=wait_for_ready)
    if not isinstance(config, EngineConfig):
        raise ValueError("An in-process engine core needs a resolved EngineConfig.")
    return InprocClient(config)


def _data_parallel_size(config: EngineConfig | EngineArgs) -> int:
    if isinstance(config, EngineConfig):
        return config.parallel_config.data_parallel_size
    return config.data_parallel_size
