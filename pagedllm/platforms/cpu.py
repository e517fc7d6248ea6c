"""``CpuPlatform``: RAM as device memory, a short scaled profiling run, glibc malloc tuning."""

from __future__ import annotations

import logging
import os
import platform
from typing import Callable

import psutil
import torch

from pagedllm import envs
from pagedllm.platforms.cpu_binding import BIND_ENV, available_cores, bind_setting, cores_for_rank
from pagedllm.platforms.cpu_malloc import trim_malloc, tune_malloc
from pagedllm.platforms.cpu_memory import peak_growth
from pagedllm.platforms.interface import Platform, worker_count_text

#: Tokens in the CPU profiling run; the measured activation peak is scaled linearly to
#: ``max_num_batched_tokens`` (activations grow linearly with tokens per step). 64, not more:
#: the run is compute-bound, and on a 2-core AVX2 CPU 256 tokens of the 0.5B shape took 1.8 s
#: of start-up (the peak measured with 64, 128 and 256 tokens: 760, 810 and 587 MB).
PROFILE_TOKENS = 64

logger = logging.getLogger(__name__)

#: ``shm`` or ``gloo``: how the tensor-parallel ranks of one machine all-reduce and
#: all-gather (``pagedllm.distributed.shm_communicator``). Default ``shm`` on x86-64
#: (measured 5-8x faster than gloo: see that module), ``gloo`` elsewhere.
COLLECTIVES_ENV = envs.PAGEDLLM_CPU_COLLECTIVES.name


class CpuPlatform(Platform):
    """x86 / Arm CPUs; attention by the C++ kernel when it builds, else portable PyTorch."""

    device_type = "cpu"
    attn_backend_preference = ("CPU_ATTN", "TORCH_SDPA")
    dist_backend = "gloo"
    ranks_share_memory = True
    #: The share of the RAM this process may use: 1 / data-parallel replicas.
    memory_share: float = 1.0

    def total_memory_bytes(self) -> int:
        """The RAM available now, in bytes (this replica's share of it)."""
        return int(psutil.virtual_memory().available * self.memory_share)

    def place_engine_replica(self, rank: int, size: int) -> str:
        """Pin this process to share ``rank`` of the CPUs it may run on (``split_cpus``), run
        as many torch (OpenMP) threads as CPUs in the share, and use 1 / ``size`` of the RAM
        available: replicas never compete for a core (on 2 cores, 2 replicas get one each).

        Raises:
            ValueError: fewer CPUs than replicas.
        """
        cpus = sorted(os.sched_getaffinity(0))
        share = split_cpus(cpus, size)[rank]
        os.sched_setaffinity(0, share)
        torch.set_num_threads(len(share))
        self.memory_share = 1.0 / size
        return f"CPU(s) {', '.join(map(str, share))} ({len(share)} thread(s), 1/{size} of the RAM)"

    def profile_activation_peak(self, dummy_run: Callable[[int], None], max_num_tokens: int) -> int:
        """The anonymous memory a ``PROFILE_TOKENS``-token dummy run adds at its peak
        (``cpu_memory.peak_growth``: the peak RSS reset first, mapped weights' pages left
        out), scaled linearly to ``max_num_tokens`` (a full-size run would dominate start-up)."""
        num_tokens = min(max_num_tokens, PROFILE_TOKENS)
        growth = peak_growth(lambda: dummy_run(num_tokens))
        return int(growth * max_num_tokens / num_tokens)

    def profile_peak(self, run: Callable[[], None]) -> int:
        """The anonymous memory ``run()`` adds at its peak (``cpu_memory.peak_growth``: the
        peak RSS reset first, so that an earlier, higher peak does not hide it; mapped pages
        left out). The free heap goes back to the kernel first (``trim_malloc``), so that
        ``run`` cannot reuse pages that are resident but not counted."""
        trim_malloc()
        return peak_growth(run)

    def check_worker_count(self, world_size: int, data_parallel_size: int = 1) -> None:
        """At least one core per worker process (under ``PAGEDLLM_CPU_OMP_THREADS_BIND``
        ``auto``; an explicit binding, which may share cores, is checked by the workers).

        Raises:
            ValueError: more workers than the cores this process may use.
        """
        cores = available_cores()
        if bind_setting() == "auto" and world_size > len(cores):
            raise ValueError(
                f"{worker_count_text(world_size, data_parallel_size)} worker processes need at least one CPU "
                f"core each, but this process may use {len(cores)} core(s) (or set {BIND_ENV} to core lists "
                f"that share cores)."
            )

    def bind_worker(self, local_rank: int, local_world_size: int) -> None:
        """Pin this process to its cores (``cpu_binding.cores_for_rank``) and give torch one
        thread per core."""
        cores = cores_for_rank(local_rank, local_world_size)
        if cores is None:
            return
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        logger.info("Worker %d of %d: cores %s, %d threads", local_rank, local_world_size, cores, len(cores))

    def use_shared_memory_collectives(self) -> bool:
        """``PAGEDLLM_CPU_COLLECTIVES`` (``shm`` / ``gloo``); by default ``shm`` on x86-64,
        whose stores are seen in order by other cores (the protocol relies on it).

        Raises:
            ValueError: another value.
        """
        default = "shm" if platform.machine().lower() in ("x86_64", "amd64") else "gloo"
        return (envs.PAGEDLLM_CPU_COLLECTIVES.get() or default) == "shm"

    def empty_cache(self) -> None:
        """Give the heap's free pages back to the kernel (``cpu_malloc.trim_malloc``)."""
        trim_malloc()

    def prepare_for_steps(self) -> None:
        """From now on step buffers stay in the heap (``cpu_malloc``); not before: the
        weights and the KV cache, allocated once, load faster as mappings of their own."""
        tune_malloc()


def split_cpus(cpus: list[int], size: int) -> list[list[int]]:
    """``cpus`` cut into ``size`` contiguous, disjoint shares whose lengths differ by at most
    one (the first shares take the remainder): ``split_cpus([0, 1, 2], 2) == [[0, 1], [2]]``.

    Raises:
        ValueError: fewer CPUs than shares.
    """
    if size > len(cpus):
        raise ValueError(
            f"data_parallel_size={size} needs at least one CPU per replica; this process may run on "
            f"{len(cpus)} CPU(s) ({', '.join(map(str, cpus))})."
        )
    base, extra = divmod(len(cpus), size)
    shares, start = [], 0
    for index in range(size):
        end = start + base + (index < extra)
        shares.append(cpus[start:end])
        start = end
    return shares
