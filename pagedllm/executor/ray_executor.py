"""``RayDistributedExecutor``: one Ray actor per rank, on the machines of a Ray cluster
(``--distributed-executor-backend ray``, vLLM's multi-node backend).

::

    head machine: engine core                       any node of the cluster
      RayDistributedExecutor                          RayWorkerWrapper actor, rank r
        placement group: world_size bundles             Worker(config, r, local_rank, tcp://rank0:port)
        actor.execute_method.remote(method, ...)  -->   run_method(worker, method, ...)
        ray.get(refs, timeout)                    <--   (True, result) | (False, exc, traceback)

Start-up, as vLLM's: connect to the running cluster (``ray.init()``: ``RAY_ADDRESS``, else
the cluster ``ray start`` left on this machine, else a new local instance, stopped again on
``shutdown``); reserve one bundle per rank in a placement group (``PACK``: as few nodes as
possible), waiting at most ``PLACEMENT_TIMEOUT_S`` for the cluster to host it; start one actor
per bundle; number the ranks with this machine's actors first and each node's actors
consecutive (so a tensor-parallel group stays on one node where it fits); rank 0's node
address and a free port there are the ``tcp://`` address every rank joins ``torch.distributed``
at. Each node loads the weights from its own filesystem (the same model path, or its Hugging
Face cache).

A rank's local world size counts the ranks on its machine (its IP address); its local rank
picks its share of that machine's cores (CPU: its index among them) or its GPU (CUDA: the
index of the GPU Ray gave its actor). Ranks spread over several machines use gloo instead of shared memory
for CPU collectives (``PAGEDLLM_CPU_COLLECTIVES``).

An actor that dies (its node lost, its process killed) fails the call at once with
``WorkerDeadError``, as with ``MultiprocExecutor``; the engine reports it and stops.

With pipeline parallelism ``execute_model(..., non_block=True)`` returns at once: a Ray
actor runs the calls of one caller in the order they were submitted, so each stage takes
the next step as soon as it is done with the previous one (one step per stage in flight).
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from concurrent.futures import Future
from typing import Any, Optional, Union

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import (
    DeferredFuture,
    Executor,
    RpcMethod,
    run_method,
)
from pagedllm.messages.runner_output import ModelRunnerOutput
from pagedllm.messages.sched_output import SchedulerOutput
from pagedllm.executor.multiproc_executor import RemoteTraceback, WorkerDeadError, _picklable
from pagedllm.platforms import current_platform
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

#: Seconds to wait for the cluster to host the placement group before refusing to start.
PLACEMENT_TIMEOUT_S = envs.PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S.get()
#: Seconds a health check waits for every actor to answer.
_HEALTH_TIMEOUT_S = 30.0
#: Seconds ``shutdown`` waits for the workers to release their memory before killing the actors.
_SHUTDOWN_TIMEOUT_S = 10.0
_COLLECTIVES_ENV = envs.PAGEDLLM_CPU_COLLECTIVES.name
#: Set in a GPU actor's environment: Ray then leaves ``CUDA_VISIBLE_DEVICES`` alone, so the
#: actor sees its node's GPUs and selects its own by index (as ``MultiprocExecutor``'s ranks).
_NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class RayWorkerWrapper:
    """The Ray actor of one rank: reports where it runs, then holds that rank's ``Worker``
    and runs the executor's calls on it."""

    def __init__(self) -> None:
        self.worker: Optional[Worker] = None

    def node_info(self) -> tuple[str, str, Optional[int]]:
        """``(Ray node id, IP address, index of the GPU Ray gave this actor among the GPUs
        its process sees, or None without one)``. The actors see all their node's GPUs
        (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``); Ray's GPU ids are indices in the
        node's ``CUDA_VISIBLE_DEVICES`` when that is set, else device indices."""
        context = ray.get_runtime_context()
        gpu_ids = [str(i) for i in context.get_accelerator_ids().get("GPU", [])]
        device = None
        if gpu_ids:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            device = visible.split(",").index(gpu_ids[0]) if visible else int(gpu_ids[0])
        return context.get_node_id(), ray.util.get_node_ip_address(), device

    def free_port(self) -> int:
        """A TCP port free now on every interface of this node (rank 0's, for ``tcp://``)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init_worker(self, config: EngineConfig, rank: int, local_rank: int, local_world_size: int,
                    distributed_init_method: str, env: dict[str, str]) -> None:
        """Set ``env`` in this process and build the Worker."""
        os.environ.update(env)
        self.worker = Worker(config, rank, local_rank, distributed_init_method, is_driver_worker=rank == 0,
                             local_world_size=local_world_size)

    def execute_method(self, method: RpcMethod, args: tuple, kwargs: dict) -> tuple:
        """``(True, result)``, or ``(False, exception, traceback text)`` for the executor to re-raise."""
        try:
            return True, run_method(self.worker, method, args, kwargs)
        except BaseException as exc:  # re-raised by the executor
            return False, _picklable(exc), "".join(traceback.format_exception(exc))

    def ping(self) -> bool:
        """True: the actor is alive (the executor's health check)."""
        return True


def resources_per_rank() -> dict[str, float]:
    """The Ray resources one rank reserves: a GPU and a CPU (CUDA), or one CPU (CPU; the
    rank then takes its share of its node's cores, ``Platform.bind_worker``)."""
    return {"GPU": 1.0, "CPU": 1.0} if current_platform.is_cuda else {"CPU": 1.0}


def assign_local_ranks(ips: list[str]) -> tuple[list[int], list[int]]:
    """For ranks on machines ``ips`` (in rank order): each rank's index among the ranks on
    its machine, and how many ranks that machine holds. ``(["a", "b", "a"]) -> ([0, 0, 1], [2, 1, 2])``."""
    seen: dict[str, int] = {}
    local_ranks = []
    for ip in ips:
        local_ranks.append(seen.get(ip, 0))
        seen[ip] = local_ranks[-1] + 1
    return local_ranks, [seen[ip] for ip in ips]


class RayDistributedExecutor(Executor):
    """Runs ``world_size`` workers as Ray actors in a placement group (rank 0 is the driver
    whose step output is returned).

    Raises (constructor):
        RuntimeError: the cluster cannot host the placement group within
            ``PLACEMENT_TIMEOUT_S`` (naming the bundles asked for and the cluster's resources).
        Exception: what a worker raised while starting, with its traceback as the cause; the
            actors are then stopped.
    """

    def _init_executor(self) -> None:
        self._failure: Optional[BaseException] = None
        self.workers: list[Any] = []
        self.placement_group: Optional[PlacementGroup] = None
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init()
        try:
            self._start_workers()
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        world_size = self.config.parallel_config.world_size
        bundles = [resources_per_rank() for _ in range(world_size)]
        self._reserve(bundles)
        self._start_actors(bundles)

    def _reserve(self, bundles: list[dict[str, float]]) -> None:
        """Create the placement group and wait for the cluster to host it."""
        world_size = len(bundles)
        self.placement_group = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise RuntimeError(
                f"The Ray cluster cannot host the placement group of {world_size} bundles {bundles[0]} "
                f"(tensor_parallel_size x pipeline_parallel_size = {world_size}) within {PLACEMENT_TIMEOUT_S:.0f} s: "
                f"the cluster has {ray.cluster_resources()} in all, {ray.available_resources()} free. Add nodes "
                f"(`ray start --address HEAD:6379`) or lower the parallel sizes."
            ) from None

    def _start_actors(self, bundles: list[dict[str, float]]) -> None:
        """One actor per bundle; number the ranks (this machine's first, each machine's
        consecutive) and build each rank's Worker. Sets ``workers`` and ``node_ids`` (the
        Ray node id of each rank), in rank order."""
        world_size = len(bundles)
        actor_class = ray.remote(RayWorkerWrapper)
        actors = [
            actor_class.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i),
                runtime_env={"env_vars": {_NOSET_CUDA_ENV: "1"}} if bundle.get("GPU") else None,
            ).remote()
            for i, bundle in enumerate(bundles)
        ]
        self.workers = actors
        infos = self._get([a.node_info.remote() for a in actors], "node_info", None)
        driver_ip = ray.util.get_node_ip_address()
        order = sorted(range(world_size), key=lambda i: (infos[i][1] != driver_ip, infos[i][1], i))
        self.workers = [actors[i] for i in order]
        self.node_ids = [infos[i][0] for i in order]
        ips = [infos[i][1] for i in order]
        local_ranks, local_sizes = assign_local_ranks(ips)
        devices = [infos[i][2] for i in order]
        if None not in devices:  # CUDA: the local rank is the GPU's index (Platform.bind_worker)
            local_ranks = devices
        port = self._get([self.workers[0].free_port.remote()], "free_port", None)[0]
        init_method = f"tcp://{ips[0]}:{port}"
        env = {_COLLECTIVES_ENV: "gloo"} if len(set(ips)) > 1 else {}
        refs = [
            actor.init_worker.remote(self.config, rank, local_ranks[rank], local_sizes[rank], init_method, env)
            for rank, actor in enumerate(self.workers)
        ]
        self._get(refs, "init_worker", None)
        logger.info("Ray workers: %d ranks on nodes %s, rank 0 at %s", world_size, self.node_ids, init_method)

    def collective_rpc(
        self, method: RpcMethod, args: tuple = (), kwargs: Optional[dict] = None, timeout: Optional[float] = None
    ) -> list:
        """Call ``method`` on every actor's worker and wait for all of them; one result per rank.

        Raises:
            WorkerDeadError: an actor died, now or before.
            TimeoutError: not every actor answered within ``timeout`` seconds.
            Exception: what a worker raised, with its traceback as the cause.
            After any of these the executor is unusable and its actors are killed.
        """
        refs = [actor.execute_method.remote(method, args, kwargs or {}) for actor in self._live_workers()]
        return self._results(refs, method, timeout)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Union[ModelRunnerOutput, Future]:
        """Submit the step to every actor; its output (``output_rank``'s), or with
        ``non_block`` at once a ``Future`` of it. Raises as ``collective_rpc``."""
        refs = [actor.execute_method.remote("execute_model", (scheduler_output,), {}) for actor in self._live_workers()]
        output_rank = self.config.parallel_config.output_rank
        if non_block:
            return DeferredFuture(lambda timeout: self._results(refs, "execute_model", timeout)[output_rank])
        return self._results(refs, "execute_model", None)[output_rank]

    def _results(self, refs: list, method: RpcMethod, timeout: Optional[float]) -> list:
        """The workers' results of ``refs`` (one per rank), re-raising a worker's exception."""
        results = []
        for rank, reply in enumerate(self._get(refs, method, timeout)):
            if not reply[0]:
                self._fail(reply[1])
                raise reply[1] from RemoteTraceback(f"in worker rank {rank}:\n{reply[2]}")
            results.append(reply[1])
        return results

    def _live_workers(self) -> list:
        if self._failure is not None:
            raise WorkerDeadError(f"The workers stopped earlier: {self._failure}") from self._failure
        return self.workers

    def _get(self, refs: list, method: RpcMethod, timeout: Optional[float]) -> list:
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        try:
            return ray.get(refs, timeout=timeout)
        except RayActorError as exc:
            error: BaseException = WorkerDeadError(f"A Ray worker actor died during {name}; the engine cannot continue: {exc}")
        except GetTimeoutError:
            error = TimeoutError(f"The Ray workers did not all answer {name} within {timeout} s.")
        self._fail(error)
        raise error

    def _fail(self, error: BaseException) -> None:
        """Remember why the executor stopped and kill the actors (the others would wait on
        the failed one in a collective)."""
        self._failure = error
        self._kill_actors()

    def _kill_actors(self) -> None:
        for actor in self.workers:
            ray.kill(actor)
        self.workers = []

    def check_health(self) -> None:
        """Raises ``WorkerDeadError`` if an actor has died (or an earlier call failed)."""
        self._get([actor.ping.remote() for actor in self._live_workers()], "a health check", _HEALTH_TIMEOUT_S)

    def shutdown(self) -> None:
        """Stop the workers, kill the actors, remove the placement group, and stop Ray if this
        executor started it; idempotent."""
        if self.workers and self._failure is None:
            try:
                ray.get([actor.execute_method.remote("shutdown", (), {}) for actor in self.workers], timeout=_SHUTDOWN_TIMEOUT_S)
            except Exception as exc:  # the actors are killed next anyway
                logger.warning("Ray workers did not shut down cleanly: %s", exc)
        self._kill_actors()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

