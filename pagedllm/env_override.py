"""Process environment pagedllm sets on import, before torch is imported (each value only
where the user has not set it).

- ``THP_MEM_ALLOC_ENABLE=1``: PyTorch's CPU allocator backs allocations of 2 MiB and more
  with transparent huge pages (``madvise(MADV_HUGEPAGE)``; c10's ``alloc_cpu``). The
  oneDNN-packed weights are allocated through it, and a batch-1 decode step streams all of
  them: with 2 MiB pages the step's matmuls read 33.1-33.6 GB/s instead of 27.8-32.7 GB/s
  (0.5B-shaped model, 2-core Zen 4, alternating in one process beside ``torch.sum`` at
  34-35 GB/s). PyTorch reads the variable once, at its first allocation, so it has no effect
  when torch was imported and used before pagedllm. It changes nothing on machines where
  THP is off (``/sys/kernel/mm/transparent_hugepage/enabled`` = never), nor on GPU memory.
  Where the kernel compacts memory on fault for such regions (``defrag`` = madvise, the
  usual default), a first touch may stall on a fragmented machine: set
  ``THP_MEM_ALLOC_ENABLE=0`` to opt out.
- With ``PAGEDLLM_CPU_ISA`` set below this CPU's level: ``ONEDNN_MAX_CPU_ISA``,
  ``ATEN_CPU_CAPABILITY`` and ``MKL_ENABLE_INSTRUCTIONS`` capped at that level, so the whole
  process runs as on such a CPU (``pagedllm.kernels.isa``).
"""

from __future__ import annotations

import os

from pagedllm.kernels import isa

DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


def apply() -> None:
    """Set each of ``DEFAULTS`` (and the ISA override's library caps) that the environment
    does not already define."""
    for name, value in {**DEFAULTS, **isa.override_library_env()}.items():
        os.environ.setdefault(name, value)
