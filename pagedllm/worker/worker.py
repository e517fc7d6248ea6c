"""The Worker: one device and the ``ModelRunner`` on it, driven by an ``Executor``.

The executor calls its steps in this order (by name, through ``collective_rpc``, so a
worker in another process answers the same calls)::

    init_device -> load_model -> determine_available_memory / determine_num_available_blocks
        -> initialize_kv_cache(num_blocks) -> execute_model(scheduler_output) ... -> shutdown

With tensor / pipeline parallelism there is one worker per rank, each in its own process
(``MultiprocExecutor``); every call reaches all of them with the same arguments. The
contract an executor relies on (the multiprocess one today, Ray's later):

- ``Worker(config, rank, local_rank, distributed_init_method, is_driver_worker)``: global
  rank (``pp_rank x tp + tp_rank``), rank among the workers of its machine (its GPU, its
  CPU cores), the ``tcp://host:port`` of rank 0, and whether it is the driver (rank 0);
- ``init_device`` binds the process to its device / cores (``Platform.bind_worker``), joins
  ``torch.distributed`` and builds the model-parallel groups;
- every rank of the last pipeline stage runs the whole step, sampling included: the logits
  are gathered on every tensor rank and each samples the same tokens (same seeds,
  bit-identical collectives), so each keeps its own persistent batch without a broadcast;
  earlier stages run their layers and learn the sampled tokens from the next step that
  schedules each request (``ModelRunner``), so they never wait for the last stage and
  several steps can be in flight, each stage running them in submission order; only ``ParallelConfig.output_rank`` (tensor rank 0 of the last stage;
  rank 0 without pipeline parallelism) returns its ``ModelRunnerOutput``, the others None.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Optional

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed import (
    destroy_distributed_environment,
    get_comm_stats,
    init_distributed_environment,
    initialize_model_parallel,
    reset_comm_stats,
)
from pagedllm.messages.runner_output import ModelRunnerOutput
from pagedllm.messages.sched_output import SchedulerOutput
from pagedllm.platforms import current_platform
from pagedllm.worker.kv_cache_sizing import KVCacheBudget, kv_cache_budget, no_kv_cache, num_kv_blocks, num_state_slots
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


#: Steps whose times a worker keeps (``Worker.step_times``).
_MAX_STEP_TIMES = 1024


class Worker:
    """Sets up one device and its ``ModelRunner``; answers the executor's calls.

    Args:
        config: the engine configuration.
        rank: this worker's global rank (0 with one worker).
        local_rank: its rank among the workers on its machine.
        distributed_init_method: ``tcp://host:port`` of rank 0 (None with one worker).
        is_driver_worker: whether this is rank 0 (the step's output comes from
            ``ParallelConfig.output_rank``, the same rank without pipeline parallelism).
        local_world_size: how many workers share its machine (None: all ``world_size`` of
            them; ``MultiprocExecutor`` counts every data-parallel replica's, Ray's workers
            span machines).
    """

    def __init__(
        self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
        distributed_init_method: Optional[str] = None, is_driver_worker: bool = True,
        local_world_size: Optional[int] = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.local_world_size = local_world_size
        self.num_steps = 0
        #: (start, end) ``time.monotonic()`` seconds of the latest steps (at most
        #: ``_MAX_STEP_TIMES``): when each stage was busy (micro-batches overlapping).
        self.step_times: deque[tuple[float, float]] = deque(maxlen=_MAX_STEP_TIMES)
        self.busy_s = 0.0  # seconds inside steps
        self._kv_cache_budget: Optional[KVCacheBudget] = None

    def init_device(self) -> None:
        """With more than one worker, bind this process to its share of the machine and
        join the others (``torch.distributed``; the data-parallel engines of
        ``ParallelConfig.data_parallel_expert_parallel`` join each other); build the model-parallel groups, pick the
        device, seed torch, and measure the device memory before the weights load (bytes;
        the KV-cache budget is a share of it; on CPU, where ranks share the RAM, this
        rank's share); builds the runner.

        Raises:
            ValueError: a worker count the machine cannot host, a bad core binding, or a GPU
                with less free memory than ``gpu_memory_utilization`` asks for.
        """
        parallel = self.config.parallel_config
        world_size = parallel.world_size
        local_world_size = self.local_world_size or world_size
        if world_size > 1:
            current_platform.bind_worker(self.local_rank, local_world_size)
            init_distributed_environment(world_size, self.rank, self.distributed_init_method or "", self.local_rank)
        dp_size = parallel.data_parallel_size if parallel.data_parallel_expert_parallel else 1
        if dp_size > 1:  # one worker per engine, the engines joined (experts spread over them)
            init_distributed_environment(dp_size, parallel.data_parallel_rank,
                                         f"tcp://127.0.0.1:{parallel.data_parallel_master_port}")
        initialize_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                                  parallel.enable_expert_parallel, dp_size)
        self.device = current_platform.device
        torch.manual_seed(self.config.model_config.seed)
        cache_config = self.config.cache_config
        if cache_config.kv_cache_memory_bytes is None and cache_config.num_gpu_blocks_override is None:
            current_platform.check_free_memory(cache_config.gpu_memory_utilization)
        self.memory_before_load = current_platform.total_memory_bytes()
        if current_platform.ranks_share_memory:
            self.memory_before_load //= local_world_size
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_available_memory(self) -> int:
        """Bytes this device can give the KV cache: ``kv_cache_memory_bytes`` when set, else
        ``gpu_memory_utilization`` x the memory measured by ``init_device`` - weights -
        the activation peak of a profiling run (run once, on the first call; with
        ``--load-format ipc_cache`` the one recorded beside the store, see ``_activation_peak``)."""
        return self._budget().num_bytes

    def determine_num_available_blocks(self) -> int:
        """KV-cache blocks that fit in ``determine_available_memory()``, after the state
        slots of a model with state layers (``kv_cache_sizing.num_state_slots``).

        Raises:
            ValueError: if they cannot hold the state slots and one sequence of
                ``max_model_len`` tokens.
        """
        spec = self.config.speculative_config
        groups = self.model_runner.kv_cache_groups
        if not groups.num_groups:  # an encoder keeps no cache: nothing to size, no profiling run
            return no_kv_cache(self.config)
        return num_kv_blocks(self.config.model_config, self.config.cache_config, self._budget(),
                             spec.draft_model_config if spec else None, groups,
                             self.config.scheduler_config.max_num_batched_tokens, num_state_slots(self.config, groups))

    def _budget(self) -> KVCacheBudget:
        if self._kv_cache_budget is None:
            activation_peak = 0
            if self.config.cache_config.kv_cache_memory_bytes is None:
                activation_peak = self._activation_peak()
            self._kv_cache_budget = kv_cache_budget(
                self.config.cache_config, self.memory_before_load, self.model_runner.weights_bytes, activation_peak
            )
        return self._kv_cache_budget

    def _activation_peak(self) -> int:
        """The profiling run's activation peak (bytes); with ``--load-format ipc_cache`` the one
        recorded beside the store by an earlier engine of the same settings, else measured
        and recorded there (``preload.ipc_cache.record_activation_peak``)."""
        model_config = self.config.model_config
        if model_config.load_format != "ipc_cache":
            return self.model_runner.profile_run()
        from pagedllm.preload.ipc_cache import record_activation_peak, recorded_activation_peak

        inputs = {"max_model_len": model_config.max_model_len, "scheduler": repr(self.config.scheduler_config),
                  "lora": repr(self.config.lora_config), "cache_dtype": str(self.config.cache_config.cache_dtype),
                  "limit_mm_per_prompt": repr(getattr(model_config, "limit_mm_per_prompt", None))}
        peak = recorded_activation_peak(model_config, inputs)
        if peak is not None:
            logger.info("Memory profile: activation peak %.1f MiB, recorded beside the store (no profiling run)",
                        peak / 2**20)
            return peak
        peak = self.model_runner.profile_run()
        record_activation_peak(model_config, inputs, peak)
        return peak

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer (the engine's choice, the same on every worker)."""
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """Run one step; the output on ``ParallelConfig.output_rank``, None on the others."""
        start = time.monotonic()
        output = self.model_runner.execute_model(scheduler_output)
        end = time.monotonic()
        self.step_times.append((start, end))
        self.busy_s += end - start
        self.num_steps += 1
        return output if self.rank == self.config.parallel_config.output_rank else None

    def execute_dummy_batch(self) -> None:
        """A step without tokens of this engine's own: serve its experts to the other
        data-parallel engines' tokens (``ModelRunner.execute_dummy_batch``)."""
        self.model_runner.execute_dummy_batch()

    def sleep(self, level: int) -> None:
        """Free the KV cache and take the weights out of memory (``ModelRunner.sleep``)."""
        self.model_runner.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        """Put back the ``tags`` (``"weights"``, ``"kv_cache"``) ``sleep`` took (``ModelRunner.wake_up``)."""
        self.model_runner.wake_up(tags)

    def get_comm_stats(self, reset: bool = False) -> dict:
        """This rank's collectives since start-up (or the last reset): ``{"steps": steps
        run, "busy_s": seconds inside them, "ops": {operation: (calls, bytes, seconds)}}``;
        ``reset`` starts the count again."""
        stats = {"steps": self.num_steps, "busy_s": self.busy_s,
                 "ops": {op: (s.calls, s.bytes, s.seconds) for op, s in get_comm_stats().items()}}
        if reset:
            reset_comm_stats()
            self.num_steps = 0
            self.busy_s = 0.0
            self.step_times.clear()
        return stats

    def shutdown(self) -> None:
        """Drop the runner (the model, the KV caches and the second KV tier's blocks and
        files go with it) and leave the model-parallel groups; idempotent. The worker answers no step afterwards."""
        if hasattr(self, "model_runner"):
            if self.model_runner.kv_connector is not None:
                self.model_runner.kv_connector.shutdown()
            if self.model_runner.kv_offload is not None:  # a process's exit runs no finalizer
                self.model_runner.kv_offload.close()
            del self.model_runner
            current_platform.empty_cache()
        parallel = self.config.parallel_config
        if parallel.world_size > 1 or parallel.data_parallel_expert_parallel:
            destroy_distributed_environment()
