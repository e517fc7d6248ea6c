"""``EngineCoreProc``: the EngineCore's own loop, in a background process (or thread),
talking to the front end over ZeroMQ with msgspec-encoded messages (vLLM V1's design).

::

    front end (AsyncLLM / MPClient)                    engine process (EngineCoreProc)
      PUSH  --[ADD | ABORT | UTILITY | SHUTDOWN]-->  PULL (binds  ipc://<dir>/input)
      PULL  <--[OUTPUTS | UTILITY | FAILED]-------   PUSH (connects ipc://<dir>/output)
      PULL  <--[READY | FAILED] (once) -----------   PUSH (connects ipc://<dir>/handshake)

Every message is two frames: a one-byte type, then the msgspec-msgpack payload. The
loop blocks on the input socket while the engine has nothing to do and otherwise runs
``EngineCore.step()`` back to back, sending one ``EngineCoreOutputs`` per step (and one
stats-only ``EngineCoreOutputs`` after input that arrived while idle, e.g. an abort, so
the front end's gauges see the freed blocks at once). Data-parallel replicas whose experts are
spread over them (``-dp N --enable-expert-parallel``) run ``_run_lockstep_loop`` instead: every
step synchronised with the others (``dp_lockstep``), a dummy step when this one has no work.

Start-up is a handshake: the process builds the EngineCore (loads the model, sizes the KV
cache) and then sends READY (its pid and the number of KV blocks) or FAILED (the
exception's type, message and traceback). A failure while running is sent as FAILED on
the output socket before the process exits with status 1. The process exits by itself
when its parent process dies (checked about once a second).
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import sys
import threading
import time
import traceback
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import msgspec
import zmq

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.executor.process_signals import follow_parent_on_signals
from pagedllm.messages.engine_core import EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    from pagedllm.engine.dp_lockstep import DPLockstep

logger = logging.getLogger(__name__)

#: How long the idle loop blocks on its input before checking that the parent lives (ms).
_IDLE_POLL_MS = 1000
#: Seconds between parent-liveness checks while busy.
_PARENT_CHECK_INTERVAL_S = 1.0
#: EngineCore methods the front end may call through a UTILITY message (plus
#: ``block_accounting``, below).
UTILITY_METHODS = frozenset({"reset_prefix_cache", "has_unfinished_requests", "sleep", "wake_up", "is_sleeping"})


def block_accounting(engine_core: Any) -> dict[str, int]:
    """The KV-block accounting check (for tests and debugging): runs the block pool's
    integrity check and returns ``num_blocks`` (those requests can hold: all but the null
    block of sliding windows), ``num_free_blocks``, ``num_unfinished_requests`` and
    ``num_requests_holding_blocks`` (in any KV-cache group).

    Raises:
        AssertionError: free + in use != total, or the prefix-cache map is inconsistent.
    """
    manager = engine_core.kv_cache_manager
    pool = manager.block_pool
    pool.check_integrity()
    return {
        "num_blocks": pool.num_usable_blocks,
        "num_free_blocks": pool.get_num_free_blocks(),
        "num_unfinished_requests": engine_core.scheduler.get_num_unfinished_requests(),
        "num_requests_holding_blocks": manager.num_requests_holding_blocks(),
    }


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of a front end -> engine message."""

    ADD = b"\x00"  # payload: EngineCoreRequest
    ABORT = b"\x01"  # payload: list[str] of engine request ids
    UTILITY = b"\x02"  # payload: UtilityCall
    SHUTDOWN = b"\x03"  # payload: empty
    START_DP_WAVE = b"\x04"  # payload: int, the wave another data-parallel engine started (dp_lockstep)


class EngineCoreOutputType(bytes, enum.Enum):
    """First frame of an engine -> front end message."""

    OUTPUTS = b"\x00"  # payload: EngineCoreOutputs
    UTILITY = b"\x01"  # payload: UtilityResult
    FAILED = b"\x02"  # payload: EngineFailure (start-up or run-time)
    READY = b"\x03"  # payload: ReadyInfo (handshake socket only)


class UtilityCall(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """Call ``EngineCore.<method>(*args)`` in the engine; answered by a ``UtilityResult``."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """The return value of a ``UtilityCall``, or the error message if it raised."""

    call_id: int
    result: Any = None
    error: Optional[str] = None


class EngineFailure(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """Why the engine stopped: the exception's type name, message and traceback text."""

    exc_type: str
    message: str
    traceback: str = ""


class ReadyInfo(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """Sent once the EngineCore is built: the engine's pid and number of KV-cache blocks."""

    pid: int
    num_gpu_blocks: int


@dataclass(frozen=True)
class EngineAddresses:
    """ZeroMQ endpoints of one engine (``ipc://`` paths in a private temp directory)."""

    directory: str
    input: str
    output: str
    handshake: str

    @classmethod
    def in_dir(cls, directory: str) -> "EngineAddresses":
        return cls(
            directory=directory,
            input=f"ipc://{directory}/input",
            output=f"ipc://{directory}/output",
            handshake=f"ipc://{directory}/handshake",
        )


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool, linger_ms: int) -> zmq.Socket:
    """A socket of ``kind`` bound or connected to ``address``, with no high-water mark (a
    send only enqueues) and ``linger_ms`` of linger on close. Used by both ends."""
    socket = ctx.socket(kind)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, linger_ms)
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return socket


def failure_from_exception(exc: BaseException) -> EngineFailure:
    return EngineFailure(
        exc_type=type(exc).__name__,
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


class EngineCoreProc:
    """The EngineCore and its ZeroMQ loop (see the module docstring for the protocol).

    Args:
        config: the engine configuration, or the ``EngineArgs`` to resolve it from (the
            EngineCore is built from it here).
        addresses: the sockets' endpoints, chosen by the client.
        parent_pid: exit when the process's parent is no longer this pid (None: never
            check, e.g. when running in a thread of the front-end process).
        dp_rank: this engine's data-parallel replica index, or None without replicas; the
            platform then gives the process its share of the machine (``place_engine_replica``)
            before the model loads.
        dp_master_port: the port the replicas join ``torch.distributed`` on when their experts
            are spread over them (``ParallelConfig.data_parallel_master_port``); they then step
            in lockstep (``dp_lockstep``).

    Raises:
        Exception: whatever building the EngineCore raised, after it was sent as FAILED
            on the handshake socket.
    """

    def __init__(
        self,
        config: EngineConfig | EngineArgs,
        addresses: EngineAddresses,
        parent_pid: Optional[int],
        dp_rank: Optional[int] = None,
        dp_master_port: Optional[int] = None,
    ) -> None:
        from pagedllm.engine.core import EngineCore  # torch import: keep it off the client's import path

        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.encoder = msgspec.msgpack.Encoder()
        self._add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._abort_decoder = msgspec.msgpack.Decoder(list[str])
        self._wave_decoder = msgspec.msgpack.Decoder(int)
        #: The wave state when the replicas step in lockstep (experts spread over them), else None.
        self.lockstep: Optional[DPLockstep] = None
        self._utility_decoder = msgspec.msgpack.Decoder(UtilityCall)
        self._shutdown_requested = False
        #: Set when the loop stopped because the parent process died.
        self.orphaned = False
        self._last_parent_check = time.monotonic()
        handshake = self._socket(zmq.PUSH, addresses.handshake, bind=False)
        try:
            try:
                if isinstance(config, EngineArgs):
                    # NOTE: the front end resolves the same arguments and logs the choices.
                    config = config.create_engine_config(log_choices=False)
                if dp_rank is not None:
                    _place_replica(dp_rank, config, dp_master_port)
                self.engine_core = EngineCore(config)
                if config.parallel_config.data_parallel_expert_parallel:
                    self.lockstep = _make_lockstep()
            except BaseException as exc:
                self._send(handshake, EngineCoreOutputType.FAILED, failure_from_exception(exc))
                handshake.close(linger=5000)
                self.ctx.term()
                raise
            self.input_socket = self._socket(zmq.PULL, addresses.input, bind=True)
            self.output_socket = self._socket(zmq.PUSH, addresses.output, bind=False)
            self._send(handshake, EngineCoreOutputType.READY, ReadyInfo(os.getpid(), self.engine_core.num_gpu_blocks))
        finally:
            if not handshake.closed:
                handshake.close(linger=5000)

    def _socket(self, kind: int, address: str, bind: bool) -> zmq.Socket:
        return make_socket(self.ctx, kind, address, bind, linger_ms=2000)

    def _send(self, socket: zmq.Socket, kind: EngineCoreOutputType, payload: Any) -> None:
        socket.send_multipart((kind.value, self.encoder.encode(payload)), copy=False)

    def run_busy_loop(self) -> None:
        """Serve until SHUTDOWN arrives or the parent process dies; raises what a step or,
        while idle (about once a second), ``EngineCore.check_health`` raises."""
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        if self.lockstep is not None:
            self._run_lockstep_loop(poller)
            return
        while not self._shutdown_requested and self._parent_alive():
            busy = self.engine_core.has_unfinished_requests()
            if not busy and not poller.poll(_IDLE_POLL_MS):
                self.engine_core.check_health()  # a dead worker stops the engine while idle too
                continue
            num_handled = self._drain_input()
            if self._shutdown_requested:
                break
            if busy or num_handled:
                self._step_and_send()

    def _run_lockstep_loop(self, poller: zmq.Poller) -> None:
        """``run_busy_loop`` for replicas in lockstep (``dp_lockstep``): idle, wait for input
        as the plain loop does; inside a wave, sync with the other replicas every step, then
        step (own requests) or run a dummy step (none), until the wave ends or all stop."""
        lockstep = self.lockstep
        while True:
            if not lockstep.running:
                if self._shutdown_requested or not self._parent_alive():
                    return
                if not poller.poll(_IDLE_POLL_MS):
                    self.engine_core.check_health()
                    continue
                if self._drain_input() and not lockstep.running and not self._shutdown_requested:
                    self._step_and_send()  # no unfinished request: the stats only, no model step
                continue
            self._drain_input()
            has_work = self.engine_core.has_unfinished_requests()
            any_work, stop = lockstep.sync(has_work, self._shutdown_requested or not self._parent_alive())
            if stop:
                return
            if has_work:
                self._step_and_send()
            elif any_work:
                self.engine_core.execute_dummy_batch()

    def _parent_alive(self) -> bool:
        if self.parent_pid is None:
            return True
        now = time.monotonic()
        if now - self._last_parent_check < _PARENT_CHECK_INTERVAL_S:
            return True
        self._last_parent_check = now
        if os.getppid() != self.parent_pid:
            logger.warning("EngineCore: parent process %d is gone; exiting.", self.parent_pid)
            self.orphaned = True
            return False
        return True

    def _drain_input(self) -> int:
        """Handle every message already waiting on the input socket; returns how many."""
        count = 0
        while True:
            try:
                kind, payload = self.input_socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return count
            count += 1
            self._handle(EngineCoreRequestType(kind.bytes), payload.buffer)

    def _handle(self, kind: EngineCoreRequestType, payload: memoryview) -> None:
        if kind is EngineCoreRequestType.ADD:
            request = self._add_decoder.decode(payload)
            self.engine_core.add_request(request)
            wave = self.lockstep.request_added() if self.lockstep is not None else None
            if wave is not None:
                self._send(self.output_socket, EngineCoreOutputType.OUTPUTS, EngineCoreOutputs(start_wave=wave))
        elif kind is EngineCoreRequestType.ABORT:
            self.engine_core.abort_requests(self._abort_decoder.decode(payload))
        elif kind is EngineCoreRequestType.UTILITY:
            self._call_utility(self._utility_decoder.decode(payload))
        elif kind is EngineCoreRequestType.START_DP_WAVE:
            if self.lockstep is not None:
                self.lockstep.start_wave(self._wave_decoder.decode(payload))
        else:
            self._shutdown_requested = True

    def _call_utility(self, call: UtilityCall) -> None:
        result = UtilityResult(call.call_id)
        if call.method == "block_accounting":
            method: Any = lambda: block_accounting(self.engine_core)  # noqa: E731
        elif call.method in UTILITY_METHODS:
            method = getattr(self.engine_core, call.method)
        else:
            result.error = f"unknown EngineCore utility method {call.method!r}"
            method = None
        if method is not None:
            try:
                result.result = method(*call.args)
            except Exception as exc:  # reported to the caller; the engine keeps serving
                result.error = f"{type(exc).__name__}: {exc}"
        self._send(self.output_socket, EngineCoreOutputType.UTILITY, result)

    def _step_and_send(self) -> None:
        self._send(self.output_socket, EngineCoreOutputType.OUTPUTS, self.engine_core.step())

    def report_failure(self, exc: BaseException) -> None:
        """Tell the front end why the loop stopped (best effort)."""
        try:
            self._send(self.output_socket, EngineCoreOutputType.FAILED, failure_from_exception(exc))
        except Exception:  # the front end may be gone already
            logger.exception("EngineCore: could not report the failure")

    def close(self) -> None:
        self.engine_core.shutdown()
        for socket in (self.input_socket, self.output_socket):
            socket.close()
        self.ctx.term()


def _place_replica(rank: int, config: EngineConfig, master_port: Optional[int] = None) -> None:
    """Make this process data-parallel replica ``rank``: a replica of one worker runs the
    model here and takes its share of the machine now (``place_engine_replica``); one of
    several workers (``-dp N -tp M``) only schedules, and its workers, started by the
    ``MultiprocExecutor``, take theirs (machine-local ranks from
    ``ParallelConfig.local_rank_offset``). ``master_port``: where replicas whose experts are
    spread over them join (``data_parallel_master_port``)."""
    from pagedllm.platforms import current_platform

    parallel = config.parallel_config = dataclasses.replace(
        config.parallel_config, data_parallel_rank=rank, data_parallel_master_port=master_port or 0)
    size = parallel.data_parallel_size
    if parallel.world_size > 1:
        logger.info("Data-parallel engine %d of %d: workers are local ranks %d-%d of %d.", rank, size,
                    parallel.local_rank_offset, parallel.local_rank_offset + parallel.world_size - 1,
                    parallel.local_world_size)
        return
    placement = current_platform.place_engine_replica(rank, size)
    logger.info("Data-parallel engine %d of %d runs on %s.", rank, size, placement)


def _make_lockstep() -> DPLockstep:
    """The ``DPLockstep`` of this replica, over the data-parallel group its worker (in this
    process: one worker per replica) joined."""
    from pagedllm.distributed import get_dp_group
    from pagedllm.engine.dp_lockstep import DPLockstep
    from pagedllm.platforms import current_platform

    return DPLockstep(get_dp_group(), current_platform.device)


def run_engine_core(
    config: EngineConfig | EngineArgs,
    addresses: EngineAddresses,
    parent_pid: Optional[int],
    install_signal_handlers: bool = True,
    dp_rank: Optional[int] = None,
    dp_master_port: Optional[int] = None,
) -> None:
    """Entry point of the engine process (``multiprocessing`` fork or spawn) or thread.

    ``config`` may be the unresolved ``EngineArgs``: the engine then resolves them itself
    (an error is reported as a start-up FAILED), so the process can be started before the
    front end has imported torch and transformers (``pagedllm serve``'s start-up).
    Builds the ``EngineCoreProc`` (data-parallel replica ``dp_rank``, or None) and serves until
    SHUTDOWN or the parent's death (SIGINT, and SIGTERM while the parent lives, are left to
    the parent: ``follow_parent_on_signals``).
    A process exits with status 1 after a start-up or run-time failure (reported to the
    client first), else 0; a thread just returns.
    """
    in_thread = threading.current_thread() is not threading.main_thread()
    if install_signal_handlers and not in_thread and parent_pid is not None:
        follow_parent_on_signals(parent_pid)
    status = 0
    try:
        proc = EngineCoreProc(config, addresses, parent_pid, dp_rank, dp_master_port)
    except BaseException:
        status = 1
    else:
        try:
            proc.run_busy_loop()
        except SystemExit:
            pass
        except BaseException as exc:
            logger.exception("EngineCore failed")
            proc.report_failure(exc)
            status = 1
        finally:
            proc.close()
        if proc.orphaned:  # nobody else will remove the sockets' directory
            shutil.rmtree(addresses.directory, ignore_errors=True)
    if not in_thread:
        # NOTE: skip the interpreter's teardown (about 2 s with torch loaded); nothing
        # is left to flush but the standard streams.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
