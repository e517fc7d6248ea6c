"""This process's resident memory on Linux, for the CPU profiling run (``CpuPlatform``).

``peak_growth(fn)`` is how much more anonymous memory (heap, ``mmap``-ed buffers, shared
memory) the process holds at its peak while ``fn`` runs than before it: the kernel's
high-water mark (``VmHWM``) is reset to the current RSS first (``/proc/self/clear_refs``,
value 5), and the pages of mapped files that ``fn`` faulted in are left out. Those are
weights mapped from a store (``--load-format ipc_cache``), counted with the weights, not
activations: a first forward over mapped weights reads them all in (the 0.5B shape's 770 MB,
which a 64-token run scaled to 2,048 tokens made a 25 GB "activation peak").

Without a resettable high-water mark (no ``/proc``, or a kernel that refuses the write) the
growth of ``getrusage``'s ``ru_maxrss`` stands in, less the same file pages: a lower bound
(zero) when the process peaked higher before, loading the weights, or its parent did (the
peak survives fork and exec: an engine process forked from the API server inherits it).

Source: proc(5) (``/proc/pid/status``, ``/proc/pid/clear_refs``), getrusage(2).
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Callable

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
#: Writing this to ``clear_refs`` resets the peak RSS (``VmHWM``) to the current RSS.
_RESET_PEAK_RSS = "5"


def memory_status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` and ``RssShmem`` of ``/proc/self/status``
    in bytes; empty where there is no ``/proc``."""
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return {}
    fields = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            fields[name] = int(value.split()[0]) * 1024  # kB
    return fields


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process to its current RSS; whether it could."""
    try:
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
    except OSError:
        return False
    return "VmHWM" in memory_status()


def peak_growth(fn: Callable[[], None]) -> int:
    """Bytes of anonymous memory the process held at its peak while running ``fn`` beyond
    what it held before (see the module docstring); never negative."""
    resettable = reset_peak_rss()
    before = memory_status()
    max_rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    fn()
    after = memory_status()
    if resettable:
        growth = after["VmHWM"] - before["VmRSS"]
    else:
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - max_rss_before
    file_pages = after.get("RssFile", 0) - before.get("RssFile", 0)
    return max(growth - max(file_pages, 0), 0)
