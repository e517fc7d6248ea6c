"""``UniProcExecutor``: one ``Worker`` in the engine core's own process."""

from __future__ import annotations

from typing import Optional

from pagedllm.executor.abstract import Executor, RpcMethod, run_method
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    """Calls its one worker directly (``distributed_executor_backend="uni"``, the default
    for a world size of 1)."""

    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.config, rank=0)
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def collective_rpc(
        self, method: RpcMethod, args: tuple = (), kwargs: Optional[dict] = None, timeout: Optional[float] = None
    ) -> list:
        """``[driver_worker.method(*args, **kwargs)]``; ``timeout`` is not enforced (the
        call runs in this thread and cannot be interrupted)."""
        return [run_method(self.driver_worker, method, args, kwargs or {})]

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
