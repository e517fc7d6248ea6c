"""``CudaPlatform``: one NVIDIA GPU; memory measured by the CUDA caching allocator."""

from __future__ import annotations

import gc
from typing import Callable

import torch

from pagedllm.platforms.interface import Platform, worker_count_text


class CudaPlatform(Platform):
    """NVIDIA GPUs, one per process: the current device (0 with one worker, a data-parallel
    replica's, or a tensor-parallel rank's); attention by portable PyTorch until a CUDA
    backend registers."""

    device_type = "cuda"
    attn_backend_preference = ("TORCH_SDPA",)
    dist_backend = "nccl"
    ray_beyond_local_devices = True

    def total_memory_bytes(self) -> int:
        """The current GPU's total memory, in bytes."""
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory

    def place_engine_replica(self, rank: int, size: int) -> str:
        """Make device ``rank`` this process's current device (``torch.device("cuda")``).

        Raises:
            ValueError: fewer visible devices than replicas.
        """
        _require_devices(size, f"data_parallel_size={size} needs one CUDA device per replica")
        torch.cuda.set_device(rank)
        return f"cuda:{rank}"

    def check_worker_count(self, world_size: int, data_parallel_size: int = 1) -> None:
        """One visible GPU per worker process.

        Raises:
            ValueError: more workers than visible GPUs.
        """
        _require_devices(
            world_size, f"{worker_count_text(world_size, data_parallel_size)} worker processes need one CUDA device each"
        )

    def bind_worker(self, local_rank: int, local_world_size: int) -> None:
        """Make GPU ``local_rank`` this process's current device (replica d of ``-dp N -tp M``:
        its workers are local ranks, so devices, d x M .. d x M + M - 1)."""
        torch.cuda.set_device(local_rank)

    def check_free_memory(self, gpu_memory_utilization: float) -> None:
        """vLLM's start-up check: the engine will take ``gpu_memory_utilization`` x the
        total memory, so at least that must be free now (other processes on the GPU).

        Raises:
            ValueError: naming the free, total and wanted GiB.
        """
        free, total = torch.cuda.mem_get_info()  # the current GPU: a replica's or a rank's
        free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()  # cached here, reusable
        wanted = gpu_memory_utilization * total
        if free < wanted:
            raise ValueError(
                f"Free memory on the GPU ({free / 2**30:.2f} of {total / 2**30:.2f} GiB) is less than "
                f"gpu_memory_utilization {gpu_memory_utilization} x total = {wanted / 2**30:.2f} GiB. "
                f"Lower --gpu-memory-utilization, set --kv-cache-memory-bytes, or free memory held by "
                f"other processes."
            )

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()`` after a garbage collection (the freed KV cache and
        weights leave the caching allocator)."""
        gc.collect()
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def profile_activation_peak(self, dummy_run: Callable[[int], None], max_num_tokens: int) -> int:
        """``torch.cuda.max_memory_allocated`` growth over a full-size dummy run."""
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        dummy_run(max_num_tokens)
        return torch.cuda.max_memory_allocated() - base

    def profile_peak(self, run: Callable[[], None]) -> int:
        """``torch.cuda.max_memory_allocated`` growth over ``run()``."""
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        return torch.cuda.max_memory_allocated() - base


def _require_devices(needed: int, what: str) -> None:
    """Raise ``ValueError("<what>; N device(s) are visible.")`` when fewer than ``needed``
    CUDA devices are visible."""
    count = torch.cuda.device_count()
    if needed > count:
        raise ValueError(f"{what}; {count} device(s) are visible (CUDA_VISIBLE_DEVICES).")
