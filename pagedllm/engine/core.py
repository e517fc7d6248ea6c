"""The EngineCore: the loop of schedule -> execute -> update, over plain-data messages.

It runs in the caller's process (offline ``LLM``) or in its own process (the server),
receiving ``EngineCoreRequest``s and returning ``EngineCoreOutputs`` either way.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
from typing import TYPE_CHECKING, Iterable, Optional

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_interface import KVCacheGroups
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_offload import OffloadingManager
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.batch_queue import BatchQueue
from pagedllm.engine.protocol import SLEEP_TAGS
from pagedllm.executor.selector import get_executor_class
from pagedllm.messages.engine_core import EngineCoreOutputs, EngineCoreRequest
from pagedllm.multimodal.budget import encoder_cache_size
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.worker.kv_cache_sizing import (
    check_num_gpu_blocks_override,
    check_state_layers_compose,
    kv_bytes_per_block,
    kv_cache_groups,
    num_state_slots,
)

if TYPE_CHECKING:
    from pagedllm.distributed.kv_transfer.base import KVConnectorScheduler

logger = logging.getLogger(__name__)


def check_offloading_fits(path: Optional[str], num_bytes: int) -> None:
    """Refuse a second KV tier of ``num_bytes`` that the host RAM available now (no ``path``)
    or the free space of the file system holding ``path`` cannot take (the tier fills lazily,
    so a size beyond them would fail only once it is full).

    Raises:
        ValueError: ``num_bytes`` over what is free.
    """
    if path is None:
        import psutil

        free, where = psutil.virtual_memory().available, "host RAM available"
    else:
        existing = os.path.abspath(path)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        free, where = shutil.disk_usage(existing).free, f"free space under {existing}"
    if num_bytes > free:
        raise ValueError(f"kv_offloading_size needs {num_bytes / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB "
                         f"of {where}; pass a smaller --kv-offloading-size.")


class EngineCore:
    """Scheduler + the executor that runs the model.

    Args:
        config: the resolved engine configuration. Building the core starts the executor
            (``get_executor_class(config)``), which loads the model, and sizes the KV cache
            (``num_gpu_blocks``: the number of KV-cache blocks, shared by the model's KV-cache
            groups: ``kv_cache_sizing.kv_cache_groups``), after the state slots of a model with
            state layers (``kv_cache_sizing.num_state_slots``).

    Raises (constructor): what ``get_executor_class`` raises for an unsupported executor;
    ``ValueError`` when the KV cache cannot hold one ``max_model_len`` sequence, or for a
    setting that does not compose with state layers (``check_state_layers_compose``), or a
    ``kv_transfer_config`` for a model with sliding windows or state layers (before loading).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        groups = kv_cache_groups(config)
        check_state_layers_compose(config, groups)
        kv_connector = self._kv_connector(groups)  # a model it cannot serve fails before loading
        self.model_executor = get_executor_class(config)(config)
        cache_config = config.cache_config
        try:
            num_gpu_blocks = self.num_gpu_blocks = self._initialize_kv_caches(groups)
            self.kv_cache_manager = KVCacheManager(
                num_blocks=num_gpu_blocks,
                block_size=cache_config.block_size,
                enable_caching=self._prefix_caching(groups),
                hash_algo=cache_config.prefix_caching_hash_algo,
                kv_cache_groups=groups,
                num_state_slots=num_state_slots(config, groups),
                offloading=self._offloading_manager(groups),
            )
        except BaseException:
            self.model_executor.shutdown()  # worker processes too
            raise
        max_loras = config.lora_config.max_loras if config.lora_config is not None else None
        self.structured_output_manager = StructuredOutputManager(config.structured_outputs_config, config.model_config)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, max_loras, config.speculative_config,
                                   structured_output_manager=self.structured_output_manager,
                                   use_pp=config.parallel_config.pipeline_parallel_size > 1,
                                   encoder_cache_size=encoder_cache_size(
                                       config.model_config.hf_config, config.scheduler_config.max_num_batched_tokens,
                                       config.model_config.model_dir,
                                       config.model_config.multimodal_config.mm_processor_kwargs),
                                   kv_connector=kv_connector)
        # Pipeline parallelism: several steps (micro-batches) in flight, one per stage.
        max_concurrent_batches = self.model_executor.max_concurrent_batches
        self.batch_queue = (BatchQueue(self.scheduler, self.model_executor, max_concurrent_batches)
                            if max_concurrent_batches > 1 else None)
        # NOTE: the model, torch and transformers leave millions of long-lived objects; moved
        # out of the collector's reach, full collections during steps stop scanning them (a
        # tiny-model 256 x 128/128 run spent 0.39 s in them inside update_from_output, 0.16 s
        # frozen). vLLM freezes its heap after start-up too.
        gc.collect()
        gc.freeze()
        self._sleeping: set[str] = set()  # the SLEEP_TAGS put to sleep and not woken yet

    def _kv_connector(self, groups: KVCacheGroups) -> Optional[KVConnectorScheduler]:
        """The scheduler side of ``kv_transfer_config``'s connector (None: no split).

        Raises:
            ValueError: a model whose layers do not all use full attention (sliding
                windows, state layers: their caches are not transferred yet).
        """
        kv_config = self.config.kv_transfer_config
        if kv_config is None:
            return None
        if groups.state_groups or groups.has_local_attention or len(groups.groups) != 1:
            raise ValueError(f"kv_transfer_config is not supported yet for {self.config.model_config.architecture}: "
                             "a prefill / decode split moves full-attention KV caches only (no sliding windows "
                             "or state layers).")
        from pagedllm.distributed.kv_transfer.factory import make_scheduler_connector

        return make_scheduler_connector(kv_config)

    def _prefix_caching(self, groups: KVCacheGroups) -> bool:
        """``enable_prefix_caching``; for a model with state layers, with an INFO line on what
        a hit needs there (vLLM's "align" mode: ``MambaManager``)."""
        enabled = self.config.cache_config.enable_prefix_caching
        if enabled and groups.state_groups:
            logger.info("Prefix caching with state layers (%s: %d of %d layers): a request's state is saved at the "
                        "last block boundary of its known tokens, and a cache hit ends where a state is saved.",
                        self.config.model_config.architecture,
                        sum(len(g.layer_indices) for g in groups.state_groups), self.config.model_config.num_layers)
        return enabled

    def _offloading_manager(self, groups: KVCacheGroups) -> Optional[OffloadingManager]:
        """The second KV tier's index (``--kv-offloading-size``): its size over one block's
        bytes on all ranks; None without one. Logs the tier at start.

        Raises:
            ValueError: the size holds no block, or more than the host RAM or disk has free.
        """
        cache_config = self.config.cache_config
        if cache_config.kv_offloading_size is None:
            return None
        block_bytes = kv_bytes_per_block(self.config.model_config, groups) * self.config.parallel_config.world_size
        num_blocks = cache_config.kv_offloading_bytes // max(block_bytes, 1)
        if num_blocks < 1:
            raise ValueError(f"kv_offloading_size {cache_config.kv_offloading_size} GiB holds no KV-cache block "
                             f"({block_bytes:,} bytes on all ranks).")
        check_offloading_fits(cache_config.kv_offloading_path, num_blocks * block_bytes)
        where = f"files under {cache_config.kv_offloading_path}" if cache_config.kv_offloading_path else "host RAM"
        logger.info("KV offloading: %.2f GiB in %s, %d blocks (%d tokens) beside the cache's %d blocks.",
                    cache_config.kv_offloading_size, where, num_blocks, num_blocks * cache_config.block_size,
                    self.num_gpu_blocks)
        return OffloadingManager(num_blocks)

    def _initialize_kv_caches(self, groups: KVCacheGroups) -> int:
        """Size the KV cache on the workers (or take ``num_gpu_blocks_override``, as vLLM),
        allocate it there (and the state slots of ``groups``' state layers); returns the
        number of blocks (0 for a model with no KV-cache group, an encoder, whatever the
        override).

        Raises:
            ValueError: an override too small for one ``max_model_len`` request in every group."""
        num_gpu_blocks = self.config.cache_config.num_gpu_blocks_override
        if num_gpu_blocks is None or not groups.num_groups:
            num_gpu_blocks = self.model_executor.determine_num_available_blocks()
        else:
            check_num_gpu_blocks_override(self.config, groups, num_gpu_blocks)
            slots = num_state_slots(self.config, groups)
            logger.info("KV cache: %d blocks, set by num_gpu_blocks_override%s", num_gpu_blocks,
                        f"; state: {slots} slots of {groups.state_bytes_per_request:,} bytes" if slots else "")
        self.model_executor.initialize_kv_cache(num_gpu_blocks)
        return num_gpu_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated, tokenized request."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests wherever they are; their blocks are freed now. Unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model once, and return what each request produced (with
        micro-batches: ``BatchQueue.step``)."""
        if self._sleeping:  # requests added while asleep wait for wake_up
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        if self.batch_queue is not None:
            return self.batch_queue.step()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if outputs.scheduler_stats is not None:
            outputs.scheduler_stats.num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        return outputs

    def execute_dummy_batch(self) -> None:
        """A step of a data-parallel engine with no requests while the others step: it joins
        their expert exchanges with no tokens (``Executor.execute_dummy_batch``)."""
        self.model_executor.execute_dummy_batch()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def check_health(self) -> None:
        """Raise if the executor lost a worker (``WorkerDeadError``), even while idle."""
        self.model_executor.check_health()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Returns False while any block is in use."""
        return self.kv_cache_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: forget the prefix cache, free the KV cache, and take the weights
        out of memory (level 1: into a file; level 2: dropped; ``pagedllm.worker.sleep_mode``).
        Steps do nothing until ``wake_up``. A no-op while asleep.

        Raises:
            ValueError: without ``enable_sleep_mode``, or a level other than 1 and 2.
            RuntimeError: while requests are unfinished (the front ends wait for them first).
        """
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError("Sleep mode is off; start the engine with --enable-sleep-mode (enable_sleep_mode=True).")
        if level not in (1, 2):
            raise ValueError(f"Sleep level must be 1 or 2, got {level!r}.")
        if self._sleeping:
            return
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("Cannot sleep while requests are unfinished; wait for them to finish.")
        self.kv_cache_manager.reset_prefix_cache()
        self.model_executor.sleep(level)
        self._sleeping = set(SLEEP_TAGS)
        logger.info("Sleeping (level %d): KV cache freed, weights %s.", level,
                    "moved to a file" if level == 1 else "dropped")

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Put back ``tags`` (``SLEEP_TAGS``; None: both); those already awake are skipped.

        Raises:
            ValueError: an unknown tag.
        """
        unknown = sorted(set(tags or ()) - set(SLEEP_TAGS))
        if unknown:
            raise ValueError(f"Unknown wake_up tags {unknown}; the tags are {', '.join(SLEEP_TAGS)}.")
        waking = [tag for tag in SLEEP_TAGS if tag in self._sleeping and (tags is None or tag in tags)]
        if waking:
            self.model_executor.wake_up(waking)
            self._sleeping -= set(waking)
            logger.info("Woke up: %s.", ", ".join(waking))

    def is_sleeping(self) -> bool:
        """Whether anything ``sleep`` took is still away."""
        return bool(self._sleeping)

    def shutdown(self) -> None:
        """Stop the executor and release the model and the KV cache; idempotent."""
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()
