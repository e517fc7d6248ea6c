"""``import pagedllm`` sets its environment defaults before torch's first allocation (so
large CPU tensors get transparent huge pages where the kernel allows them) and leaves a
value the user set alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import os, pagedllm, torch
big = torch.ones(64 << 20)  # 256 MiB
huge_kb = sum(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), huge_kb)
"""


def _run(env_value):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=120)
    value, huge_kb = out.stdout.split()
    return value, int(huge_kb)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_huge_pages_default_and_user_override():
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp_possible = thp.exists() and "[never]" not in thp.read_text()
    value, huge_kb = _run(None)
    assert value == "1"
    if thp_possible:
        assert huge_kb >= 128 << 10  # at least half of the 256 MiB tensor in 2 MiB pages
    value, huge_kb = _run("0")
    assert value == "0"
    if thp.exists() and "[always]" not in thp.read_text():
        assert huge_kb < 64 << 10
