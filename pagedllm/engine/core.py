"""The EngineCore: the loop of schedule -> execute -> update, over plain-data messages.

It runs in the caller's process (offline ``LLM``) or in its own process (the server),
receiving ``EngineCoreRequest``s and returning ``EngineCoreOutputs`` either way.
"""

from __future__ import annotations

import logging
from typing import Iterable

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages.engine_core import EngineCoreOutputs, EngineCoreRequest
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    """Scheduler + model runner.

    Args:
        config: the resolved engine configuration. Building the core loads the model and
            sizes the KV cache (``config.cache_config.num_gpu_blocks`` is set).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)
        cache_config = config.cache_config
        assert cache_config.num_gpu_blocks is not None
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_gpu_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
        )
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated, tokenized request."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests wherever they are; their blocks are freed now. Unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model once, and return what each request produced."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if outputs.scheduler_stats is not None:
            outputs.scheduler_stats.num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Returns False while any block is in use."""
        return self.kv_cache_manager.reset_prefix_cache()
