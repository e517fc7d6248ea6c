"""``DPAsyncMPClient``: ``data_parallel_size`` engine cores behind one front end (vLLM's
``--data-parallel-size`` with internal load balancing, its ``DPLBAsyncMPClient``).

::

    AsyncLLM ──add_request──▶ DPRouter ──▶ AsyncMPClient 0 ──ZeroMQ──▶ EngineCoreProc (DP 0)
             ◀──outputs────── merged queue ◀─ AsyncMPClient 1 ──ZeroMQ──▶ EngineCoreProc (DP 1)
                (engine_index set per replica)        ...

Each replica is a whole engine (scheduler, KV cache, model) in its own process, given
its own share of the machine before it loads the model (``Platform.place_engine_replica``: on
CPU a disjoint set of cores with as many threads, on CUDA its own device). Requests are routed
by ``DPRouter`` (least loaded, prefix-cache affinity); an abort goes to the replica that serves
the request; every ``EngineCoreOutputs`` carries the replica's index (``engine_index``) so the
metrics can be labelled per engine (vLLM's ``engine`` label).

Experts spread over the replicas (``-dp N --enable-expert-parallel`` on a mixture-of-experts
model): the replicas join ``torch.distributed`` on a port chosen here and step in lockstep
(``dp_lockstep``); this client is their coordinator: when a replica announces a wave it started
(``EngineCoreOutputs.start_wave``), the others are told to join it (START_DP_WAVE).

Failure: the replicas live and die together, as in vLLM. When one dies or fails, the client is
dead: ``get_output_async`` raises ``EngineDeadError`` naming the replica (the front end fails
every open request with it), every later call raises it, and the server exits non-zero so
that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable, Optional

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core_client import AsyncMPClient, EngineCoreClient, next_output
from pagedllm.engine.dp_router import DPRouter
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.messages.engine_core import EngineCoreOutputs, EngineCoreRequest
from pagedllm.network import get_open_port

logger = logging.getLogger(__name__)


class DPAsyncMPClient(EngineCoreClient):
    """asyncio client of ``data_parallel_size`` engine-core processes (see the module docstring).

    Args:
        config: the engine configuration, or ``EngineArgs`` (each replica resolves them).
        wait_for_ready: False returns once the processes are started; call ``wait_for_ready``.

    Raises (constructor, ``wait_for_ready``): as ``AsyncMPClient``; a replica's start-up error
    (e.g. fewer CPUs or devices than replicas, with the numbers) stops all of them.

    Attributes:
        replicas: one ``AsyncMPClient`` per replica, by index.
        router: the ``DPRouter``.
    """

    def __init__(self, config: EngineConfig | EngineArgs, wait_for_ready: bool = True) -> None:
        if isinstance(config, EngineConfig):
            size, block_size = config.parallel_config.data_parallel_size, config.cache_config.block_size
        else:
            size, block_size = config.data_parallel_size, config.block_size
        self.router = DPRouter(size, block_size)
        self.replicas: list[AsyncMPClient] = []
        self._dead_error: Optional[EngineDeadError] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queue: Optional[asyncio.Queue] = None
        self._forwarders: list[asyncio.Task] = []
        self.num_gpu_blocks: Optional[int] = None
        master_port = get_open_port()  # used by replicas whose experts are spread over them
        try:
            for rank in range(size):
                self.replicas.append(AsyncMPClient(config, wait_for_ready=False, dp_rank=rank,
                                                   dp_master_port=master_port))
        except BaseException:
            self.shutdown(timeout_s=0)
            raise
        if wait_for_ready:
            self.wait_for_ready(config if isinstance(config, EngineConfig) else None)

    def wait_for_ready(self, config: Optional[EngineConfig] = None) -> None:
        """Block until every replica is ready; ``num_gpu_blocks`` is the smallest replica's
        (``config``: unused, the interface's).

        Raises:
            ValueError, EngineStartupError: a replica failed to start (all are stopped).
        """
        try:
            for replica in self.replicas:
                replica.wait_for_ready()
        except BaseException:
            self.shutdown(timeout_s=0)
            raise
        self.num_gpu_blocks = min(replica.num_gpu_blocks or 0 for replica in self.replicas)

    @property
    def engine_pids(self) -> list[int]:
        """The replicas' process ids, by index (once ready)."""
        return [pid for replica in self.replicas for pid in replica.engine_pids]

    # -- liveness ---------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        if self._dead_error is None:
            for rank, replica in enumerate(self.replicas):
                if replica.is_dead:
                    self._mark_dead(rank, replica.dead_error)
                    break
        return self._dead_error is not None

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        return self._dead_error if self.is_dead else None

    def _mark_dead(self, rank: int, error: Optional[BaseException]) -> None:
        if self._dead_error is not None:
            return
        dead = EngineDeadError(f"Data-parallel engine {rank} (of {len(self.replicas)}) is dead: {error}")
        dead.__cause__ = error.__cause__ if isinstance(error, EngineDeadError) else error
        logger.error("%s", dead)
        self._dead_error = dead

    def _check_alive(self) -> None:
        if self.is_dead:
            assert self._dead_error is not None
            raise self._dead_error.fresh()

    # -- outputs ------------------------------------------------------------------------------

    def _ensure_forwarders(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._queue = loop, asyncio.Queue()
            self._forwarders = [
                loop.create_task(self._forward(rank, replica, self._queue), name=f"EngineCoreOutputForwarder{rank}")
                for rank, replica in enumerate(self.replicas)
            ]
        assert self._queue is not None
        return self._queue

    async def _forward(self, rank: int, replica: AsyncMPClient, queue: asyncio.Queue) -> None:
        """Move replica ``rank``'s outputs to the merged queue, tagged with its index; on its
        death, mark the client dead and queue the error."""
        try:
            while True:
                outputs = await replica.get_output_async()
                outputs.engine_index = rank
                if outputs.start_wave is not None:
                    for other, peer in enumerate(self.replicas):
                        if other != rank:
                            peer.start_dp_wave(outputs.start_wave)
                    if not outputs.outputs and outputs.scheduler_stats is None:
                        continue
                for output in outputs.outputs:
                    if output.finish_reason is not None:
                        self.router.finish(output.request_id)
                queue.put_nowait(outputs)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # EngineDeadError, or a bug: fail loudly, never hang
            self._mark_dead(rank, error)
            queue.put_nowait(self._dead_error)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs of any replica (``engine_index`` says which); raises
        ``EngineDeadError`` once a replica died or failed (also in calls waiting then)."""
        return await next_output(self._ensure_forwarders(), self._check_alive)

    # -- requests -----------------------------------------------------------------------------

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """Send ``request`` to the replica ``DPRouter`` chooses.

        Raises:
            EngineDeadError: a replica is dead.
        """
        self._check_alive()
        self._ensure_forwarders()
        rank = self.router.route(request)
        try:
            await self.replicas[rank].add_request_async(request)
        except BaseException:
            self.router.finish(request.request_id)
            raise

    def engine_index_of(self, request_id: str) -> int:
        """The replica serving ``request_id`` (0 once it finished)."""
        rank = self.router.replica_of(request_id)
        return 0 if rank is None else rank

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort each request in its replica, without awaiting; finished or unknown ids are
        ignored (a no-op once the engine is dead)."""
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.router.finish(request_id)
            if rank is not None:
                by_replica.setdefault(rank, []).append(request_id)
        for rank, ids in by_replica.items():
            self.replicas[rank].abort_requests(ids)

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        self.abort_requests(request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> list[Any]:
        """Run ``EngineCore.<method>(*args)`` in every replica; returns their results by index.

        Raises: as ``AsyncMPClient.call_utility_async``.
        """
        self._check_alive()
        return list(await asyncio.gather(*(replica.call_utility_async(method, *args) for replica in self.replicas)))

    async def reset_prefix_cache_async(self) -> bool:
        """Reset every replica's prefix cache; False if any had blocks in use."""
        return all(await self.call_utility_async("reset_prefix_cache"))

    # -- teardown -----------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every replica (each gets ``timeout_s`` seconds, then is terminated); idempotent."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            for task in self._forwarders:
                task.cancel()
        for replica in self.replicas:
            replica.shutdown(timeout_s)
        if self._dead_error is None:
            self._dead_error = EngineDeadError("The engine core was shut down.")
