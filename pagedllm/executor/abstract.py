"""The Executor: how the EngineCore reaches its workers, wherever they run.

The engine core talks to one ``Executor``; the executor fans each call out to its workers
(``collective_rpc``) and gathers one result per worker. ``UniProcExecutor`` holds one
``Worker`` in the engine's own process; ``MultiprocExecutor`` one worker process per rank
(tensor / pipeline parallelism on one machine); ``RayDistributedExecutor`` answers the same
calls from Ray actors on several machines (see ``worker/worker.py`` for the contract).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Callable, Optional, Union

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.messages.runner_output import ModelRunnerOutput
from pagedllm.messages.sched_output import SchedulerOutput

#: What ``collective_rpc`` calls: a ``Worker`` method name, or a callable taking the worker first.
RpcMethod = Union[str, Callable]

#: Micro-batches in flight with pipeline parallelism, 1 .. pipeline_parallel_size (default:
#: pipeline_parallel_size); 1 runs one step at a time, to measure what micro-batches bring.
PP_MAX_CONCURRENT_BATCHES_ENV = envs.PAGEDLLM_PP_MAX_CONCURRENT_BATCHES.name


class DeferredFuture(Future):
    """A ``Future`` whose ``result()`` does the waiting itself, in the caller's thread
    (``wait(timeout)`` returns the value or raises), once; no thread runs in the background."""

    def __init__(self, wait: Callable[[Optional[float]], Any]) -> None:
        super().__init__()
        self._wait = wait

    def result(self, timeout: Optional[float] = None) -> Any:
        if not self.done():
            try:
                self.set_result(self._wait(timeout))
            except BaseException as exc:  # re-raised below, as Future.result does
                self.set_exception(exc)
        return super().result()


def pipeline_max_concurrent_batches(pipeline_parallel_size: int) -> int:
    """Steps an executor of ``pipeline_parallel_size`` stages keeps in flight: one per stage
    (vLLM's ``max_concurrent_batches``), or ``PAGEDLLM_PP_MAX_CONCURRENT_BATCHES`` when set
    (at most one per stage).

    Raises:
        ValueError: the variable is set but not a positive integer.
    """
    steps = envs.PAGEDLLM_PP_MAX_CONCURRENT_BATCHES.get()
    return pipeline_parallel_size if steps is None else min(steps, pipeline_parallel_size)


def run_method(obj: Any, method: RpcMethod, args: tuple, kwargs: dict) -> Any:
    """``obj.method(*args, **kwargs)`` for a method name, or ``method(obj, *args, **kwargs)``
    for a callable (it receives the worker as its first argument)."""
    if isinstance(method, str):
        return getattr(obj, method)(*args, **kwargs)
    return method(obj, *args, **kwargs)


class Executor(ABC):
    """Runs the workers of one engine and gathers their answers.

    Building an executor starts its workers and loads the model on them; the engine core
    then sizes the KV cache (``determine_num_available_blocks``), allocates it
    (``initialize_kv_cache``) and runs steps (``execute_model``).

    Args:
        config: the engine configuration (``parallel_config`` chooses the executor).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers, set up their devices and load the model."""

    @abstractmethod
    def collective_rpc(
        self, method: RpcMethod, args: tuple = (), kwargs: Optional[dict] = None, timeout: Optional[float] = None
    ) -> list:
        """Call ``method`` on every worker and wait for all of them.

        Args:
            method: a ``Worker`` method name, or a callable taking the worker first.
            args, kwargs: its arguments (the same for every worker).
            timeout: seconds to wait; None waits for ever.

        Returns:
            one result per worker, in rank order.
        """

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core may have in flight at once (``execute_model`` with
        ``non_block``): one per pipeline stage (1 without pipeline parallelism; see
        ``pipeline_max_concurrent_batches``)."""
        return pipeline_max_concurrent_batches(self.config.parallel_config.pipeline_parallel_size)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Union[ModelRunnerOutput, Future]:
        """Run one step on every worker; the output of ``ParallelConfig.output_rank`` (tensor
        rank 0 of the last pipeline stage; rank 0 without pipeline parallelism), or with
        ``non_block`` a ``Future`` of it (vLLM's signature). Here the step runs before
        returning either way; ``MultiprocExecutor`` and ``RayDistributedExecutor`` return
        at once, and their workers run the steps in the order they were submitted."""
        output = self.collective_rpc("execute_model", args=(scheduler_output,))[self.config.parallel_config.output_rank]
        if not non_block:
            return output
        future: Future = Future()
        future.set_result(output)
        return future

    def execute_dummy_batch(self) -> None:
        """Run a step without tokens on every worker (``Worker.execute_dummy_batch``): a
        data-parallel engine with no requests of its own joins the others' expert exchanges."""
        self.collective_rpc("execute_dummy_batch")

    def check_health(self) -> None:
        """Raise if a worker can no longer answer (the engine core checks while idle).
        Default: workers in this process are always there."""

    def determine_available_memory(self) -> int:
        """Bytes every worker can give the KV cache (the smallest worker's)."""
        return min(self.collective_rpc("determine_available_memory"))

    def determine_num_available_blocks(self) -> int:
        """KV-cache blocks every worker can hold (the smallest worker's).

        Raises:
            ValueError: if a worker cannot hold one sequence of ``max_model_len`` tokens.
        """
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV-cache blocks on every worker."""
        self.collective_rpc("initialize_kv_cache", args=(num_blocks,))

    def sleep(self, level: int) -> None:
        """Put every worker to sleep (``Worker.sleep``)."""
        self.collective_rpc("sleep", args=(level,))

    def wake_up(self, tags: list[str]) -> None:
        """Wake ``tags`` up on every worker (``Worker.wake_up``)."""
        self.collective_rpc("wake_up", args=(tags,))

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release their memory; idempotent."""

