"""``tune_malloc``: after it, a 64 MiB step buffer comes from the heap (glibc's
``mallinfo2`` counts no new mmapped bytes) and the heap stops growing after a few steps
(the buffer is reused); before it, glibc maps such a buffer afresh every step. An engine on
CPU applies it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc settings"
)

PROBE = """
import ctypes, sys, torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    from pagedllm.platforms.cpu_malloc import tune_malloc
    assert tune_malloc() and tune_malloc()
mapped, arena = [], []
for step in range(12):  # a step: a 64 MiB buffer, small allocations meanwhile, then freed
    before = libc.mallinfo2().hblkhd
    x = torch.ones(16 << 20)
    mapped.append(libc.mallinfo2().hblkhd - before)
    small = [torch.ones(100) for _ in range(50)]
    del x, small
    arena.append(libc.mallinfo2().arena)
print(min(mapped), arena[-1] - arena[4])
"""


def _probe(mode):
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "0"}  # plain malloc, no 2 MiB alignment
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=120, env=env)
    return [int(v) for v in out.stdout.split()]


def test_large_step_buffers_stay_in_the_heap():
    mapped, _ = _probe("plain")
    assert mapped >= 64 << 20  # glibc's default: every step maps (and faults in) its own
    mapped, arena_growth = _probe("tuned")
    assert mapped == 0  # from the heap
    assert arena_growth == 0  # reused step after step: the heap stops growing


def test_cpu_engine_applies_it(tiny_llama):
    from pagedllm import LLM
    from pagedllm.platforms import cpu_malloc

    LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=4 << 20)
    assert cpu_malloc._done
