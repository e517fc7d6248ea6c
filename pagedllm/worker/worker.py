"""The Worker: one device and the ``ModelRunner`` on it, driven by an ``Executor``.

The executor calls its steps in this order (by name, through ``collective_rpc``, so a
worker in another process answers the same calls)::

    init_device -> load_model -> determine_available_memory / determine_num_available_blocks
        -> initialize_kv_cache(num_blocks) -> execute_model(scheduler_output) ... -> shutdown
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed import initialize_model_parallel
from pagedllm.messages.runner_output import ModelRunnerOutput
from pagedllm.messages.sched_output import SchedulerOutput
from pagedllm.platforms import current_platform
from pagedllm.worker.kv_cache_sizing import KVCacheBudget, kv_cache_budget, num_kv_blocks
from pagedllm.worker.model_runner import ModelRunner


class Worker:
    """Sets up one device and its ``ModelRunner``; answers the executor's calls.

    Args:
        config: the engine configuration.
        rank: this worker's rank among the executor's workers (0 with one worker).
    """

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self._kv_cache_budget: Optional[KVCacheBudget] = None

    def init_device(self) -> None:
        """Join the model-parallel group (a single process today), pick the device, seed
        torch, and measure the device memory free before the weights load (bytes; the
        KV-cache budget is a share of it); builds the runner.

        Raises:
            NotImplementedError: a tensor-parallel size above 1 (not supported yet).
            ValueError: a GPU with less free memory than ``gpu_memory_utilization`` asks for.
        """
        initialize_model_parallel(self.config.parallel_config.tensor_parallel_size)
        self.device = current_platform.device
        torch.manual_seed(self.config.model_config.seed)
        cache_config = self.config.cache_config
        if cache_config.kv_cache_memory_bytes is None and cache_config.num_gpu_blocks_override is None:
            current_platform.check_free_memory(cache_config.gpu_memory_utilization)
        self.memory_before_load = current_platform.total_memory_bytes()
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_available_memory(self) -> int:
        """Bytes this device can give the KV cache: ``kv_cache_memory_bytes`` when set, else
        ``gpu_memory_utilization`` x the memory measured by ``init_device`` - weights -
        the activation peak of a profiling run (run once, on the first call)."""
        return self._budget().num_bytes

    def determine_num_available_blocks(self) -> int:
        """KV-cache blocks that fit in ``determine_available_memory()``.

        Raises:
            ValueError: if they cannot hold one sequence of ``max_model_len`` tokens.
        """
        spec = self.config.speculative_config
        return num_kv_blocks(self.config.model_config, self.config.cache_config, self._budget(),
                             spec.draft_model_config if spec else None)

    def _budget(self) -> KVCacheBudget:
        if self._kv_cache_budget is None:
            activation_peak = 0
            if self.config.cache_config.kv_cache_memory_bytes is None:
                activation_peak = self.model_runner.profile_run()
            self._kv_cache_budget = kv_cache_budget(
                self.config.cache_config, self.memory_before_load, self.model_runner.weights_bytes, activation_peak
            )
        return self._kv_cache_budget

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer (the engine's choice, the same on every worker)."""
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Drop the runner (the model and the KV caches go with it); idempotent. The worker
        answers no step afterwards."""
        if hasattr(self, "model_runner"):
            del self.model_runner
            current_platform.empty_cache()
