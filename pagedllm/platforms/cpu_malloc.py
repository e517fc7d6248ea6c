"""glibc malloc settings for CPU inference.

Every step allocates and frees the same large activation tensors (the logits of a
256-request step are 16 MB in bf16; the MLP works in 16 MiB row chunks). glibc serves
requests above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh ``mmap``
regions and returns free heap tops above its trim threshold (128 KiB) to the kernel, so
each step faults its buffers in again and the kernel zeroes every page. With both
thresholds at 1 GiB the buffers stay in the heap and are reused from step to step — what
the allocators vLLM's CPU guide recommends preloading (tcmalloc, jemalloc) do by design.
The process keeps the heap it has used at its peak instead of shrinking after it.

Measured with ``pagedllm bench throughput`` on tiny-llama, 256 x (128 in, 128 out), bf16,
2-core Zen 4, three alternating pairs: 7,165 / 6,742 / 7,346 -> 7,977 / 7,741 / 8,136
output tok/s. ``CpuPlatform.prepare_for_steps`` applies it once the runner has loaded the
weights and allocated the KV cache, which keep mappings of their own (loading the 0.5B
shape's weights under it took 1.0-1.6 s instead of 0.7-0.8 s).

``trim_malloc`` gives the free heap back when memory is to be handed back (``empty_cache``).

Source: glibc's ``mallopt(3)`` (``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``), ``malloc_trim(3)``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds to ``THRESHOLD_BYTES`` for this process (once).
    Returns whether they are set; False, changing nothing, off Linux / glibc or if glibc
    refuses a value."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES) == 1
    except (OSError, AttributeError) as exc:
        logger.debug("mallopt unavailable: %s", exc)
        return False
    if not ok:
        logger.debug("glibc refused mallopt thresholds of %d bytes", THRESHOLD_BYTES)
        return False
    _done = True
    return True


def trim_malloc() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim(0)``): after sleep
    mode frees the weights and the KV cache, which the raised thresholds keep in the heap.
    Returns whether memory was released; False off Linux / glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError) as exc:
        logger.debug("malloc_trim unavailable: %s", exc)
        return False
