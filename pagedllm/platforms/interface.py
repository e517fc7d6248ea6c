"""``Platform``: the device-specific facts and hooks behind one interface.

Everything else in pagedllm asks ``current_platform`` (``pagedllm.platforms``) instead of
testing for CUDA itself; a new device is a new subclass.
"""

from __future__ import annotations

from typing import Callable

import torch


class Platform:
    """The device pagedllm runs on. Subclasses: ``CpuPlatform``, ``CudaPlatform``.

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"``.
        attn_backend_preference: names of the attention backends the automatic selection
            tries, best first (``pagedllm.attention.selector``); the first that can run wins.
        dist_backend: the ``torch.distributed`` backend joining the workers of one model
            (tensor / pipeline parallelism): ``"gloo"`` on CPU, ``"nccl"`` on CUDA.
        ranks_share_memory: whether the workers on one machine draw on one memory (CPU: the
            RAM; each then sizes its KV cache from its share), not one device each.
        ray_beyond_local_devices: whether more workers than this machine's devices default
            to the Ray executor (vLLM's rule on GPUs) rather than being refused.
    """

    device_type: str = ""
    attn_backend_preference: tuple[str, ...] = ()
    dist_backend: str = ""
    ranks_share_memory: bool = False
    ray_beyond_local_devices: bool = False

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def total_memory_bytes(self) -> int:
        """Memory in bytes that weights, activations and the KV cache share."""
        raise NotImplementedError

    def check_free_memory(self, gpu_memory_utilization: float) -> None:
        """Check, before the weights load, that the device has the share of its memory the
        engine will take free. Default: nothing to check (host memory is not reserved).

        Raises:
            ValueError: where the free memory is below the share.
        """

    def empty_cache(self) -> None:
        """Hand the memory freed by a shut-down engine back to the device, so that another
        process can take it. Default: nothing (host memory goes back to the allocator)."""

    def half_dtype(self) -> torch.dtype:
        """The 16-bit dtype to use when a float32 checkpoint is loaded with dtype "auto"."""
        return torch.bfloat16

    def synchronize(self) -> None:
        """Wait for the device's queued work (no-op where work is synchronous)."""

    def profile_activation_peak(self, dummy_run: Callable[[int], None], max_num_tokens: int) -> int:
        """Peak activation memory (bytes) of a forward over ``max_num_tokens`` tokens.

        Args:
            dummy_run: runs a forward over the number of tokens it is given.
            max_num_tokens: the step token budget (``max_num_batched_tokens``).
        """
        raise NotImplementedError

    def profile_peak(self, run: Callable[[], None]) -> int:
        """Peak memory (bytes) above the use at the call while ``run()`` runs, at its full size
        (not scaled): the vision encoder's profile on its largest image."""
        raise NotImplementedError

    def check_worker_count(self, world_size: int, data_parallel_size: int = 1) -> None:
        """Refuse ``world_size`` worker processes on this machine (those of all
        ``data_parallel_size`` replicas) when it cannot give each its own device (GPU) or
        core (CPU).

        Raises:
            ValueError: naming the numbers asked for and the number available.
        """
        raise NotImplementedError

    def bind_worker(self, local_rank: int, local_world_size: int) -> None:
        """Give the calling worker process its share of this machine: its device (GPU
        ``local_rank``) or its cores (CPU); called once, first thing in ``Worker.init_device``.
        ``local_world_size`` counts the workers of every data-parallel replica on the machine."""
        raise NotImplementedError

    def use_shared_memory_collectives(self) -> bool:
        """Whether the tensor-parallel all-reduce and all-gather of ranks on this machine go
        through shared memory (``pagedllm.distributed.shm_communicator``) instead of
        ``torch.distributed`` on ``dist_backend``. Default: no."""
        return False

    def prepare_for_steps(self) -> None:
        """Process-wide settings for the step loop, applied once by the model runner after
        the weights and the KV cache are allocated. Default: none."""

    def place_engine_replica(self, rank: int, size: int) -> str:
        """Give this process (data-parallel engine replica ``rank`` of ``size``, vLLM's
        ``--data-parallel-size``) its own share of the machine, before the model loads.
        Called in the replica's process only when ``size`` > 1. Returns what the replica got,
        in words (for the log).

        Raises:
            ValueError: the machine has fewer units (cores, devices) than replicas.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot place data-parallel replicas")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def worker_count_text(world_size: int, data_parallel_size: int = 1) -> str:
    """How ``world_size`` workers came about, for start-up errors:
    ``"tensor_parallel_size x pipeline_parallel_size = 2"``, or with replicas
    ``"data_parallel_size 2 x tensor_parallel_size x pipeline_parallel_size 2 = 4"``."""
    if data_parallel_size == 1:
        return f"tensor_parallel_size x pipeline_parallel_size = {world_size}"
    return (f"data_parallel_size {data_parallel_size} x tensor_parallel_size x pipeline_parallel_size "
            f"{world_size // data_parallel_size} = {world_size}")
