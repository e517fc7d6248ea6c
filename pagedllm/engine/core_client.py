"""Clients of the EngineCore: the same interface whether the core runs in this process or
in its own (vLLM V1's ``EngineCoreClient``).

- ``InprocClient``: the EngineCore lives in the caller's process; ``get_output()`` runs
  one step. For offline use and tests.
- ``MPClient``: the EngineCore runs in a background process (``EngineCoreProc``, forked
  or spawned: ``pagedllm.executor.mp_context``) and talks over ZeroMQ; blocking calls.
- ``AsyncMPClient``: the same with asyncio: outputs are read by a task through
  ``zmq.asyncio``, so the event loop never blocks on the engine. With
  ``engine_in_thread=True`` the identical loop runs in a thread of this process instead
  (``AsyncLLM(multiprocess=False)``).

``client_factory.make_client`` chooses the client for a front end.

Failure handling (both background clients):

- Start-up is a handshake (see ``core_proc``): ``wait_for_ready`` (called by the
  constructor unless ``wait_for_ready=False``) returns once the engine has loaded the
  model and sized its KV cache, or raises the engine's error
  (``ValueError`` for bad settings, e.g. a KV budget too small; else
  ``EngineStartupError``). It never hangs on a dead engine: it polls every 100 ms and
  checks that the process is alive.
- After start-up, the client notices within ``_POLL_MS`` (200 ms) of polling that the
  engine died (exit without a FAILED message) or failed (FAILED message); it then marks
  itself dead and every call, including pending ``get_output*`` and utility calls,
  raises ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import shutil
import tempfile
import threading
import weakref
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable, Optional, Union

import msgspec
import zmq
import zmq.asyncio

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core_proc import (
    EngineAddresses,
    EngineCoreOutputType,
    EngineCoreRequestType,
    EngineFailure,
    ReadyInfo,
    UtilityCall,
    UTILITY_METHODS,
    UtilityResult,
    make_socket,
    run_engine_core,
)
from pagedllm.engine.exceptions import EngineDeadError, EngineStartupError
from pagedllm.executor.mp_context import get_mp_context, start
from pagedllm.messages.engine_core import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

#: Output-socket poll interval (ms): the longest a dead engine goes unnoticed while a
#: reader waits.
_POLL_MS = 200
#: Seconds ``shutdown`` waits for the engine to exit before terminating it.
_SHUTDOWN_TIMEOUT_S = 5.0


class EngineCoreClient(ABC):
    """What a front end (``LLMEngine``, ``AsyncLLM``) needs from the EngineCore.

    Sync methods are for ``InprocClient`` and ``MPClient``; ``*_async`` methods for
    ``AsyncMPClient``. ``get_output*`` returns the next step's ``EngineCoreOutputs``;
    ``abort_requests*`` takes engine request ids (children of ``n > 1``, not parents).
    ``reset_prefix_cache*`` returns False while blocks are in use.
    """

    #: Number of KV-cache blocks the engine allocated (known after start-up).
    num_gpu_blocks: int = 0

    @property
    def is_dead(self) -> bool:
        return False

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        """The error in-flight and later calls raise, or None while the engine lives."""
        return None

    def wait_for_ready(self, config: Optional[EngineConfig] = None) -> None:
        """Block until the engine can serve (background clients; an ``InprocClient`` is ready
        when built)."""

    @property
    def engine_pids(self) -> list[int]:
        """The engine-core processes' ids (none when the engine runs in this process)."""
        return []

    def engine_index_of(self, request_id: str) -> int:
        """The data-parallel replica serving ``request_id`` (0: one engine core)."""
        return 0

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        raise NotImplementedError

    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        raise NotImplementedError

    async def reset_prefix_cache_async(self) -> bool:
        raise NotImplementedError

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and release its resources; idempotent."""


class InprocClient(EngineCoreClient):
    """The EngineCore in this process; ``get_output()`` runs one step.

    Raises (constructor): what ``EngineCore`` raises (``ValueError`` for bad settings).
    """

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.engine.core import EngineCore

        self.engine_core = EngineCore(config)
        self.num_gpu_blocks = self.engine_core.num_gpu_blocks

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def call_utility(self, method: str, *args: Any) -> Any:
        """``EngineCore.<method>(*args)`` (one of ``UTILITY_METHODS``), as ``MPClient.call_utility``."""
        if method not in UTILITY_METHODS:
            raise RuntimeError(f"unknown EngineCore utility method {method!r}")
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class _EngineHandle:
    """The background engine: a process (forked or spawned: ``mp_context``), or a daemon
    thread of this process."""

    def __init__(
        self, config: EngineConfig | EngineArgs, addresses: EngineAddresses, in_thread: bool, dp_rank: Optional[int],
        dp_master_port: Optional[int] = None,
    ) -> None:
        self.in_thread = in_thread
        self.worker: Union[threading.Thread, Any]
        if in_thread:
            self.worker = threading.Thread(
                target=run_engine_core, args=(config, addresses, None, False), name="EngineCore", daemon=True
            )
            self.worker.start()
            return
        context = get_mp_context()
        self.worker = context.Process(
            target=run_engine_core,
            args=(config, addresses, os.getpid(), True, dp_rank, dp_master_port),
            name="EngineCore" if dp_rank is None else f"EngineCore_DP{dp_rank}",
        )
        start(context, self.worker)

    @property
    def pid(self) -> int:
        return os.getpid() if self.in_thread else self.worker.pid

    def is_alive(self) -> bool:
        return self.worker.is_alive()

    def describe_exit(self) -> str:
        if self.in_thread:
            return "The engine core thread stopped."
        return f"The engine core process (pid {self.worker.pid}) exited with code {self.worker.exitcode}."

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the engine to exit; then kill it (it ignores SIGTERM
        while this process lives: ``follow_parent_on_signals``)."""
        self.worker.join(timeout_s)
        if self.in_thread or not self.worker.is_alive():
            return
        self.worker.kill()
        self.worker.join(2.0)


def _cleanup(handle: _EngineHandle, sockets: list[zmq.Socket], ctx: zmq.Context, directory: str) -> None:
    """Last-resort teardown (also run at interpreter exit): stop the engine, free sockets."""
    if handle.is_alive() and not handle.in_thread:
        handle.stop(0.0)
    for socket in sockets:
        socket.close(linger=0)
    ctx.term()
    shutil.rmtree(directory, ignore_errors=True)


def _remote_traceback(failure: EngineFailure) -> RuntimeError:
    """The engine's traceback as an exception, to chain as ``__cause__``."""
    return RuntimeError(f"Engine core traceback:\n{failure.traceback}")


def _startup_error(failure: EngineFailure) -> Exception:
    cause = _remote_traceback(failure)
    if failure.exc_type == "ValueError":
        error: Exception = ValueError(failure.message)
    else:
        error = EngineStartupError(
            f"The engine core failed to start: {failure.exc_type}: {failure.message}", failure.traceback
        )
    error.__cause__ = cause
    return error


async def next_output(queue: asyncio.Queue, check_alive: Callable[[], None]) -> EngineCoreOutputs:
    """The next ``EngineCoreOutputs`` of an async client's queue, where a reader puts the
    engine's ``EngineDeadError`` last. ``check_alive`` raises it when the queue is empty and
    the engine is already known dead.

    Raises:
        EngineDeadError: the engine died or failed (also for calls waiting when it did).
    """
    if queue.empty():
        check_alive()
    item = await queue.get()
    if isinstance(item, EngineDeadError):
        queue.put_nowait(item)  # every later caller sees it too
        raise item.fresh()
    return item


class _BackgroundClient(EngineCoreClient):
    """Common part of ``MPClient`` and ``AsyncMPClient``: sockets, engine start-up
    handshake, the input channel, liveness and shutdown.

    The input channel is a plain (blocking-API) PUSH socket that *connects* with an
    unlimited high-water mark, so a send only enqueues and never blocks, even before the
    engine binds or after it died.

    ``config`` may be the ``EngineArgs`` (the engine resolves them) and
    ``wait_for_ready=False`` returns at once after starting the engine: the caller does
    its own start-up work meanwhile and then calls ``wait_for_ready``. ``dp_rank``: the
    engine is data-parallel replica ``dp_rank`` (a process; see ``dp_client``), or None;
    ``dp_master_port``: where the replicas join when their experts are spread over them.
    """

    def __init__(
        self,
        config: EngineConfig | EngineArgs,
        engine_in_thread: bool = False,
        wait_for_ready: bool = True,
        dp_rank: Optional[int] = None,
        dp_master_port: Optional[int] = None,
    ) -> None:
        self._directory = tempfile.mkdtemp(prefix="pagedllm-engine-")
        self.addresses = EngineAddresses.in_dir(self._directory)
        self.ctx = zmq.Context()
        self.encoder = msgspec.msgpack.Encoder()
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._utility_decoder = msgspec.msgpack.Decoder(UtilityResult)
        self._failure_decoder = msgspec.msgpack.Decoder(EngineFailure)
        self._dead_error: Optional[EngineDeadError] = None
        self._call_ids = itertools.count()
        self._handshake = self._make_socket(self.ctx, zmq.PULL, self.addresses.handshake, bind=True)
        self.output_socket = self._make_output_socket()
        self.input_socket = self._make_socket(self.ctx, zmq.PUSH, self.addresses.input, bind=False)
        self.handle = _EngineHandle(config, self.addresses, engine_in_thread, dp_rank, dp_master_port)
        sockets = [self._handshake, self.input_socket, self.output_socket]
        self._finalizer = weakref.finalize(self, _cleanup, self.handle, sockets, self.ctx, self._directory)
        self.num_gpu_blocks: Optional[int] = None
        self.engine_pid: Optional[int] = None
        if wait_for_ready:
            self.wait_for_ready(config if isinstance(config, EngineConfig) else None)

    def wait_for_ready(self, config: Optional[EngineConfig] = None) -> None:
        """Block until the engine reports READY; set ``num_gpu_blocks`` and ``engine_pid``
        (``config``: unused, the interface's).

        Raises:
            ValueError: the engine rejected its settings (message from the engine).
            EngineStartupError: the engine crashed or raised another error while starting.
        """
        if self.engine_pid is not None:
            return
        try:
            info = self._wait_for_ready(self._handshake)
        except BaseException:
            self._dead_error = EngineDeadError("The engine core failed to start.")
            self.handle.stop(_SHUTDOWN_TIMEOUT_S)
            self._finalizer()
            raise
        finally:
            self._handshake.close(linger=0)
        self.num_gpu_blocks = info.num_gpu_blocks
        self.engine_pid = info.pid

    @property
    def engine_pids(self) -> list[int]:
        if self.handle.in_thread or self.engine_pid is None:
            return []
        return [self.engine_pid]

    @staticmethod
    def _make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
        return make_socket(ctx, kind, address, bind, linger_ms=0)

    @abstractmethod
    def _make_output_socket(self) -> zmq.Socket:
        """Bind the PULL socket the engine's outputs arrive on."""

    def _wait_for_ready(self, handshake: zmq.Socket) -> ReadyInfo:
        while True:
            if handshake.poll(100):
                kind, payload = handshake.recv_multipart()
                if kind == EngineCoreOutputType.READY.value:
                    return msgspec.msgpack.decode(payload, type=ReadyInfo)
                raise _startup_error(self._failure_decoder.decode(payload))
            if not self.handle.is_alive():
                if handshake.poll(0):
                    continue  # it reported its failure just before exiting
                raise EngineStartupError(
                    f"{self.handle.describe_exit()} It died while starting; see its log above."
                )

    # -- liveness ---------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        if self._dead_error is None and not self.handle.is_alive():
            self._mark_dead(EngineDeadError(self.handle.describe_exit()))
        return self._dead_error is not None

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        return self._dead_error if self.is_dead else None

    def _mark_dead(self, error: EngineDeadError) -> None:
        if self._dead_error is None:
            logger.error("%s", error)
            self._dead_error = error

    def _mark_failed(self, payload: Any) -> None:
        failure = self._failure_decoder.decode(payload)
        error = EngineDeadError(f"The engine core failed: {failure.exc_type}: {failure.message}")
        error.__cause__ = _remote_traceback(failure)
        self._mark_dead(error)

    def _check_alive(self) -> None:
        if self.is_dead:
            assert self._dead_error is not None
            raise self._dead_error.fresh()

    # -- input channel ----------------------------------------------------------------------

    def _send(self, kind: EngineCoreRequestType, payload: Any = b"") -> None:
        data = payload if isinstance(payload, bytes) else self.encoder.encode(payload)
        self.input_socket.send_multipart((kind.value, data), copy=False)

    def _send_abort(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        if request_ids and not self.is_dead:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def start_dp_wave(self, wave: int) -> None:
        """Tell a data-parallel engine in lockstep that another one started ``wave``
        (``dp_lockstep``); a no-op once the engine is dead."""
        if not self.is_dead:
            self._send(EngineCoreRequestType.START_DP_WAVE, wave)

    def _new_utility_call(self, method: str, args: tuple) -> UtilityCall:
        self._check_alive()
        call = UtilityCall(next(self._call_ids), method, list(args))
        return call

    @staticmethod
    def _utility_value(result: UtilityResult) -> Any:
        if result.error is not None:
            raise RuntimeError(f"EngineCore utility call failed: {result.error}")
        return result.result

    def shutdown(self, timeout_s: float = _SHUTDOWN_TIMEOUT_S) -> None:
        """Ask the engine to exit (SHUTDOWN), wait up to ``timeout_s`` seconds, then
        terminate it (0: at once, e.g. when start-up is abandoned); idempotent."""
        if not self._finalizer.alive:
            return
        if self.handle.is_alive():
            try:
                self._send(EngineCoreRequestType.SHUTDOWN)
            except zmq.ZMQError:
                pass
            self.handle.stop(timeout_s)
        if self._dead_error is None:
            self._dead_error = EngineDeadError("The engine core was shut down.")
        self._finalizer()


class MPClient(_BackgroundClient):
    """Blocking client of an EngineCore in a background process.

    Args:
        config: the engine configuration, or ``EngineArgs`` (see ``_BackgroundClient``);
            ``num_gpu_blocks`` is the engine's once it is ready.
        engine_in_thread: run the engine loop in a thread of this process instead.
        wait_for_ready: False returns at once (see ``_BackgroundClient``).

    Raises (constructor):
        ValueError: the engine rejected its settings (message from the engine).
        EngineStartupError: the engine crashed or raised another error while starting.
    """

    def __init__(
        self, config: EngineConfig | EngineArgs, engine_in_thread: bool = False, wait_for_ready: bool = True
    ) -> None:
        self._pending_outputs: collections.deque[EngineCoreOutputs] = collections.deque()
        self._utility_results: dict[int, UtilityResult] = {}
        super().__init__(config, engine_in_thread, wait_for_ready)

    def _make_output_socket(self) -> zmq.Socket:
        return self._make_socket(self.ctx, zmq.PULL, self.addresses.output, bind=True)

    def _receive_one(self, timeout_ms: int) -> bool:
        """Read one message (outputs are queued, utility results stored); False on timeout.

        Raises:
            EngineDeadError: the engine failed or exited.
        """
        if not self.output_socket.poll(timeout_ms):
            self._check_alive()
            return False
        kind, payload = self.output_socket.recv_multipart(copy=False)
        if kind.bytes == EngineCoreOutputType.OUTPUTS.value:
            self._pending_outputs.append(self._outputs_decoder.decode(payload.buffer))
        elif kind.bytes == EngineCoreOutputType.UTILITY.value:
            result = self._utility_decoder.decode(payload.buffer)
            self._utility_results[result.call_id] = result
        else:
            self._mark_failed(payload.buffer)
            self._check_alive()
        return True

    def get_output(self, timeout_s: Optional[float] = None) -> EngineCoreOutputs:
        """The next step's outputs, waiting up to ``timeout_s`` seconds (None: forever).

        Raises:
            EngineDeadError: the engine died or failed.
            TimeoutError: nothing arrived within ``timeout_s``.
        """
        waited_ms = 0
        while not self._pending_outputs:
            self._check_alive()
            if timeout_s is not None and waited_ms >= timeout_s * 1000:
                raise TimeoutError(f"No engine output within {timeout_s} s.")
            if not self._receive_one(_POLL_MS):
                waited_ms += _POLL_MS
        return self._pending_outputs.popleft()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort in the engine (no-op once the engine is dead)."""
        self._send_abort(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.<method>(*args)`` in the engine and return its result.

        Raises:
            EngineDeadError: the engine died.
            RuntimeError: the method raised in the engine (or is not allowed).
        """
        call = self._new_utility_call(method, args)
        self._send(EngineCoreRequestType.UTILITY, call)
        while call.call_id not in self._utility_results:
            self._receive_one(_POLL_MS)
        return self._utility_value(self._utility_results.pop(call.call_id))

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))


class AsyncMPClient(_BackgroundClient):
    """asyncio client of an EngineCore in a background process (or thread).

    A reader task (created in the running event loop on first use, and again if the
    client is later used from another loop) polls the output socket through
    ``zmq.asyncio``, queues ``EngineCoreOutputs`` for ``get_output_async``, resolves
    utility calls, and checks every 200 ms of silence that the engine is still alive.

    Args / Raises (constructor): as ``MPClient``. The constructor blocks until the engine
    is ready (model loaded): create the client before serving, not inside a request.
    """

    def __init__(
        self,
        config: EngineConfig | EngineArgs,
        engine_in_thread: bool = False,
        wait_for_ready: bool = True,
        dp_rank: Optional[int] = None,
        dp_master_port: Optional[int] = None,
    ) -> None:
        self._reader: Optional[asyncio.Task] = None
        self._reader_loop: Optional[asyncio.AbstractEventLoop] = None
        self._outputs_queue: Optional[asyncio.Queue] = None
        self._utility_futures: dict[int, asyncio.Future] = {}
        super().__init__(config, engine_in_thread, wait_for_ready, dp_rank, dp_master_port)

    def _make_output_socket(self) -> zmq.Socket:
        self.async_ctx = zmq.asyncio.Context.shadow(self.ctx)
        return self._make_socket(self.async_ctx, zmq.PULL, self.addresses.output, bind=True)

    def _ensure_reader(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        if self._reader_loop is not loop or self._reader is None or self._reader.done():
            if self._reader_loop is not loop:
                self._outputs_queue = asyncio.Queue()
                self._utility_futures.clear()
                self._reader_loop = loop
            if self._dead_error is None or self._reader is None:
                self._reader = loop.create_task(
                    self._read_outputs(self._outputs_queue), name="EngineCoreOutputReader"
                )
        assert self._outputs_queue is not None
        return self._outputs_queue

    async def _read_outputs(self, queue: asyncio.Queue) -> None:
        socket = self.output_socket
        try:
            while self._dead_error is None:
                if not await socket.poll(_POLL_MS):
                    if not self.handle.is_alive() and not await socket.poll(0):
                        self._mark_dead(EngineDeadError(self.handle.describe_exit()))
                    continue
                kind, payload = await socket.recv_multipart(copy=False)
                if kind.bytes == EngineCoreOutputType.OUTPUTS.value:
                    queue.put_nowait(self._outputs_decoder.decode(payload.buffer))
                elif kind.bytes == EngineCoreOutputType.UTILITY.value:
                    self._resolve_utility(self._utility_decoder.decode(payload.buffer))
                else:
                    self._mark_failed(payload.buffer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # closed by shutdown(), or a bug: fail loudly, never hang
            if self._finalizer.alive:
                logger.exception("EngineCore output reader failed")
                error = EngineDeadError(f"Reading engine outputs failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                self._mark_dead(error)
        finally:
            if self._dead_error is not None:
                queue.put_nowait(self._dead_error)
                for future in self._utility_futures.values():
                    if not future.done():
                        future.set_exception(self._dead_error.fresh())
                self._utility_futures.clear()

    def _resolve_utility(self, result: UtilityResult) -> None:
        future = self._utility_futures.pop(result.call_id, None)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(RuntimeError(f"EngineCore utility call failed: {result.error}"))
        else:
            future.set_result(result.result)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs.

        Raises:
            EngineDeadError: the engine died or failed (also for calls waiting when it did).
        """
        return await next_output(self._ensure_reader(), self._check_alive)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self._ensure_reader()
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort in the engine without awaiting (safe in ``finally`` blocks and callbacks);
        a no-op once the engine is dead."""
        self._send_abort(request_ids)

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        self._send_abort(request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.<method>(*args)`` in the engine and return its result.

        Raises:
            EngineDeadError: the engine died (before or while waiting).
            RuntimeError: the method raised in the engine (or is not allowed).
        """
        self._ensure_reader()
        call = self._new_utility_call(method, args)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call.call_id] = future
        self._send(EngineCoreRequestType.UTILITY, call)
        return await future

    async def reset_prefix_cache_async(self) -> bool:
        return bool(await self.call_utility_async("reset_prefix_cache"))

    def shutdown(self, timeout_s: float = _SHUTDOWN_TIMEOUT_S) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._reader_loop:
                reader.cancel()
        super().shutdown(timeout_s)
