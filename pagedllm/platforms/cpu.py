"""``CpuPlatform``: RAM as device memory, a short scaled profiling run, glibc malloc tuning."""

from __future__ import annotations

import resource
from typing import Callable

import psutil

from pagedllm.platforms.cpu_malloc import tune_malloc
from pagedllm.platforms.interface import Platform

#: Tokens in the CPU profiling run; the measured activation peak is scaled linearly to
#: ``max_num_batched_tokens`` (activations grow linearly with tokens per step). 64, not more:
#: the run is compute-bound, and on a 2-core AVX2 CPU 256 tokens of the 0.5B shape took 1.8 s
#: of start-up (the peak measured with 64, 128 and 256 tokens: 760, 810 and 587 MB).
PROFILE_TOKENS = 64


class CpuPlatform(Platform):
    """x86 / Arm CPUs; attention by the C++ kernel when it builds, else portable PyTorch."""

    device_type = "cpu"
    attn_backend_preference = ("CPU_ATTN", "TORCH_SDPA")

    def total_memory_bytes(self) -> int:
        """The RAM available now, in bytes."""
        return psutil.virtual_memory().available

    def profile_activation_peak(self, dummy_run: Callable[[int], None], max_num_tokens: int) -> int:
        """The growth of the process's peak RSS over a ``PROFILE_TOKENS``-token dummy run,
        scaled linearly to ``max_num_tokens`` (a full-size run would dominate start-up)."""
        num_tokens = min(max_num_tokens, PROFILE_TOKENS)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        dummy_run(num_tokens)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return int(max(after - before, 0) * max_num_tokens / num_tokens)

    def prepare_for_steps(self) -> None:
        """From now on step buffers stay in the heap (``cpu_malloc``); not before: the
        weights and the KV cache, allocated once, load faster as mappings of their own."""
        tune_malloc()
