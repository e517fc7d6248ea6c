"""``MultiprocExecutor``: one worker process per rank on this machine (``"mp"``, the
default for a world size above 1).

::

    engine core process                              worker process, rank r (forked or spawned)
      MultiprocExecutor                                run_worker: Worker(config, r, ...)
        pipe r  --(method, args, kwargs) pickled-->     loop: recv, run, reply
                <--(ok, result) | (error, exc, tb)--
        process r's sentinel: readable once it has exited

Each call is pickled once and written to every worker's pipe (``multiprocessing``
connections); the executor then waits on the pipes and the processes' sentinels together
(``multiprocessing.connection.wait``), so a worker that dies is noticed at once: the call
raises ``WorkerDeadError`` naming the rank, pid and exit status, instead of waiting for
ever. A worker exits when its pipe closes (the executor's process died) or on
``shutdown``.

Calls may overlap (``execute_model(..., non_block=True)``, pipeline parallelism): a
thread in each worker reads its pipe into a queue as calls arrive, so the executor's
writes never wait for a busy worker; the worker runs them in order and answers each in
order, and the executor matches each answer to the oldest call that rank has not
answered yet. So stage 0 starts step 2 while stage 1 still runs step 1.

Ranks on CPU are pinned to disjoint cores and on CUDA each gets one GPU
(``Platform.bind_worker``, called by ``Worker.init_device``); they join ``torch.distributed``
at ``tcp://127.0.0.1:<free port>``. With data-parallel replicas (``-dp N -tp M``) each
replica's executor spawns its own M workers with their own rendezvous port, as machine-local
ranks ``dp_rank x M ..`` of ``N x M`` (``ParallelConfig.local_rank_offset``): replica d's
workers take the d-th M of the N x M core sets (CPU) or devices ``d x M .. d x M + M - 1``.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import signal
import threading
import time
import traceback
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Optional, Union

from pagedllm.config import EngineConfig
from pagedllm.distributed.utils import get_open_port
from pagedllm.executor.abstract import (
    DeferredFuture,
    Executor,
    RpcMethod,
    run_method,
)
from pagedllm.executor.mp_context import WORKER_MULTIPROC_METHOD_ENV, close_in_child, get_mp_context, start
from pagedllm.executor.process_signals import follow_parent_on_signals
from pagedllm.messages.runner_output import ModelRunnerOutput
from pagedllm.messages.sched_output import SchedulerOutput
from pagedllm.platforms import current_platform
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

#: Seconds ``shutdown`` waits for workers to exit before terminating them.
_SHUTDOWN_WAIT_S = 5.0
_SHUTDOWN = "__shutdown__"
#: The calls of start-up, during which a worker that exits most likely failed to start.
_START_UP_METHODS = ("init_device", "load_model")


class WorkerDeadError(RuntimeError):
    """A worker process exited (or its pipe broke) while the engine needed it; the executor
    cannot continue (the engine reports it as dead)."""


class RemoteTraceback(Exception):
    """The traceback, as text, of an exception raised in a worker process (set as the
    ``__cause__`` of the exception re-raised here)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class _WorkerHandle:
    rank: int
    process: Any  # a multiprocessing Process (fork or spawn)
    conn: Connection

    def describe_exit(self) -> str:
        code = self.process.exitcode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


@dataclass
class _Call:
    """One call written to every worker: its answers so far (by rank) and the ranks that
    have not answered yet."""

    method: RpcMethod
    results: list
    pending: set[int] = field(default_factory=set)


def _read_calls(conn: Connection, calls: queue.SimpleQueue) -> None:
    """Move the executor's calls from ``conn`` to ``calls`` as they arrive; None once the
    pipe closes (the executor's process is gone)."""
    while True:
        try:
            calls.put(conn.recv_bytes())
        except (EOFError, OSError):
            calls.put(None)
            return


def run_worker(
    config: EngineConfig, rank: int, local_rank: int, distributed_init_method: str, conn: Connection,
    inherited: tuple[Connection, ...] = (),
) -> None:
    """Entry point of a worker process: answer the executor's calls on ``conn``, in order,
    until it sends the shutdown call or closes the pipe. Replies ``(True, result)`` or
    ``(False, exception, traceback text)``. ``inherited``: the executor's pipe ends a forked
    worker holds copies of (its own pipe's other end included), closed first so that the
    pipe closes when the executor's process dies."""
    for other in inherited:
        other.close()
    follow_parent_on_signals(os.getppid())  # group signals reach the engine too; it decides
    worker = Worker(config, rank, local_rank, distributed_init_method, is_driver_worker=rank == 0,
                    local_world_size=config.parallel_config.local_world_size)
    calls: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_calls, args=(conn, calls), name="PagedLLMWorkerCalls", daemon=True).start()
    while True:
        payload = calls.get()
        if payload is None:
            break
        method, args, kwargs = pickle.loads(payload)
        if method == _SHUTDOWN:
            worker.shutdown()
            conn.send((True, None))
            break
        try:
            reply: tuple = (True, run_method(worker, method, args, kwargs))
        except BaseException as exc:  # sent to the executor, which re-raises it
            reply = (False, _picklable(exc), "".join(traceback.format_exception(exc)))
        conn.send(reply)


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class MultiprocExecutor(Executor):
    """Spawns ``world_size`` worker processes (local rank = ``local_rank_offset`` + rank on
    this one machine; the step output is that of ``ParallelConfig.output_rank``) and calls
    them through pipes.

    Raises (constructor):
        ValueError: more workers (of all data-parallel replicas) than this machine has cores
            (CPU) or GPUs (CUDA).
        Exception: what a worker raised while starting (set-up, loading the model), re-raised
            here with the worker's traceback as its cause; the workers are then stopped.
    """

    def _init_executor(self) -> None:
        parallel = self.config.parallel_config
        world_size = parallel.world_size
        current_platform.check_worker_count(parallel.local_world_size, parallel.data_parallel_size)
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        context = get_mp_context()
        self._start_method = context.get_start_method()
        self.workers: list[_WorkerHandle] = []
        self._failure: Optional[BaseException] = None
        # Calls written to the workers and not answered by all of them, oldest first.
        self._calls: deque[_Call] = deque()
        for rank in range(world_size):
            conn, child_conn = context.Pipe(duplex=True)
            inherited = tuple(close_in_child(context, [w.conn for w in self.workers] + [conn]))
            process = context.Process(
                target=run_worker,
                args=(self.config, rank, parallel.local_rank_offset + rank, init_method, child_conn, inherited),
                name=_worker_name(parallel.data_parallel_size, parallel.data_parallel_rank, rank), daemon=True,
            )
            start(context, process)
            child_conn.close()
            self.workers.append(_WorkerHandle(rank, process, conn))
        # NOTE: the workers ignore SIGTERM while this process lives, and multiprocessing's own
        # exit handler SIGTERMs daemonic children and then joins them: a script that ends
        # without shutting the engine down would wait for ever. This handler, registered
        # later, runs first (atexit is last in, first out) and stops the workers properly.
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        try:
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    @property
    def start_method(self) -> str:
        """How the workers were started: ``fork`` or ``spawn`` (``mp_context.get_mp_context``)."""
        return self._start_method

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' pids, in rank order."""
        return [w.process.pid for w in self.workers]

    def collective_rpc(
        self, method: RpcMethod, args: tuple = (), kwargs: Optional[dict] = None, timeout: Optional[float] = None
    ) -> list:
        """Call ``method`` on every worker (a name, or a picklable callable taking the
        worker first) and wait for all of them (and for the calls still running before
        it); one result per rank (None from ranks other than ``output_rank`` for
        ``execute_model``).

        Raises:
            WorkerDeadError: a worker exited, now or before.
            TimeoutError: not every worker answered within ``timeout`` seconds.
            Exception: what a worker raised, with its traceback as the cause.
            After any of these the executor is unusable and its workers are terminated
            (the others may wait on the failed one in a collective; late answers would be
            taken for the next call's).
        """
        return self._wait(self._submit(method, args, kwargs or {}), timeout)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Union[ModelRunnerOutput, Future]:
        """Write the step to every worker; its output (``output_rank``'s), or with
        ``non_block`` at once a ``Future`` of it, waited for by its ``result()``. Raises as
        ``collective_rpc`` (from ``result()`` with ``non_block``)."""
        call = self._submit("execute_model", (scheduler_output,), {})
        output_rank = self.config.parallel_config.output_rank
        if non_block:
            return DeferredFuture(lambda timeout: self._wait(call, timeout)[output_rank])
        return self._wait(call, None)[output_rank]

    def _submit(self, method: RpcMethod, args: tuple, kwargs: dict) -> _Call:
        if self._failure is not None:
            raise WorkerDeadError(f"The workers stopped earlier: {self._failure}") from self._failure
        payload = pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        call = _Call(method, [None] * len(self.workers), {w.rank for w in self.workers})
        self._calls.append(call)
        for worker in self.workers:
            try:
                worker.conn.send_bytes(payload)
            except OSError:
                self._raise_dead(worker, method)
        return call

    def _wait(self, call: _Call, timeout: Optional[float]) -> list:
        """Read answers until every rank has answered ``call`` (each rank answers its calls
        in order, so the earlier calls are complete by then too)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sentinels = {worker.process.sentinel: worker for worker in self.workers}
        while call.pending:
            if self._failure is not None:
                raise WorkerDeadError(f"The workers stopped earlier: {self._failure}") from self._failure
            pending = {self.workers[rank].conn: self.workers[rank] for rank in call.pending}
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready = wait([*pending, *sentinels], remaining)
            if not ready:
                ranks = sorted(call.pending)
                error = TimeoutError(f"Workers of ranks {ranks} did not answer {_name(call.method)} within {timeout} s.")
                self._fail(error)
                raise error
            for obj in ready:
                worker = pending.get(obj) if isinstance(obj, Connection) else None
                if worker is not None:
                    self._take_answer(worker)
            for obj in ready:
                if not isinstance(obj, Connection):
                    self._raise_dead(sentinels[obj], call.method)
        return call.results

    def _take_answer(self, worker: _WorkerHandle) -> None:
        """Receive ``worker``'s next answer into the oldest call it has not answered."""
        call = next(c for c in self._calls if worker.rank in c.pending)
        call.results[worker.rank] = self._receive(worker, call.method)
        call.pending.discard(worker.rank)
        while self._calls and not self._calls[0].pending:
            self._calls.popleft()

    def _receive(self, worker: _WorkerHandle, method: RpcMethod) -> Any:
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            self._raise_dead(worker, method)
        if reply[0]:
            return reply[1]
        self._fail(reply[1])
        raise reply[1] from RemoteTraceback(f"in worker rank {worker.rank}:\n{reply[2]}")

    def _raise_dead(self, worker: _WorkerHandle, method: RpcMethod) -> None:
        worker.process.join(1.0)  # reap it, for its exit status
        hint = ""
        if method in _START_UP_METHODS and self._start_method == "spawn":
            hint = (" A script that starts workers must keep its top-level code under "
                    "`if __name__ == \"__main__\":` (spawned workers import it again; see "
                    f"{WORKER_MULTIPROC_METHOD_ENV[0]}).")
        error = WorkerDeadError(
            f"Worker rank {worker.rank} (pid {worker.process.pid}) died ({worker.describe_exit()}) during "
            f"{_name(method)}; the engine cannot continue.{hint}"
        )
        self._fail(error)
        raise error

    def _fail(self, error: BaseException) -> None:
        """Remember why the executor stopped and terminate the workers still running: the
        others cannot finish a step without the failed one (they would wait in a collective)."""
        self._failure = error
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.kill()
        for worker in self.workers:
            worker.process.join(1.0)

    def check_health(self) -> None:
        """Raises ``WorkerDeadError`` if a worker has exited (or an earlier call failed)."""
        if self._failure is not None:
            raise WorkerDeadError(f"The workers stopped earlier: {self._failure}") from self._failure
        for worker in self.workers:
            if not worker.process.is_alive():
                self._raise_dead(worker, "a health check")

    def shutdown(self) -> None:
        """Ask the workers to exit, then kill those still running after ``_SHUTDOWN_WAIT_S``
        (they ignore SIGTERM while this process lives); idempotent."""
        payload = pickle.dumps((_SHUTDOWN, (), {}))
        for worker in self.workers:
            if worker.process.is_alive():
                try:
                    worker.conn.send_bytes(payload)
                except OSError:
                    pass
        deadline = time.monotonic() + _SHUTDOWN_WAIT_S
        for worker in self.workers:
            worker.process.join(max(deadline - time.monotonic(), 0.0))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(1.0)
            worker.conn.close()
        self.workers = []


def _shutdown_at_exit(executor_ref: "weakref.ref[MultiprocExecutor]") -> None:
    executor = executor_ref()
    if executor is not None:
        executor.shutdown()


def _worker_name(dp_size: int, dp_rank: int, rank: int) -> str:
    return f"PagedLLMWorker-{rank}" if dp_size == 1 else f"PagedLLMWorker-DP{dp_rank}-{rank}"


def _name(method: RpcMethod) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))
