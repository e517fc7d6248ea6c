"""``CudaPlatform.check_free_memory``: vLLM's start-up check that the share of the GPU the
engine will take (``gpu_memory_utilization`` x total) is free; the device query is stubbed,
so this runs without a GPU."""

from __future__ import annotations

import pytest
import torch

from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cuda import CudaPlatform

GIB = 2**30


def test_enough_free_memory_passes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 140 * GIB))
    CudaPlatform().check_free_memory(0.7)


def test_memory_held_elsewhere_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 140 * GIB))
    with pytest.raises(ValueError) as err:
        CudaPlatform().check_free_memory(0.9)
    message = str(err.value)
    assert "100.00 of 140.00 GiB" in message and "126.00 GiB" in message and "--gpu-memory-utilization" in message


def test_cpu_reserves_nothing():
    CpuPlatform().check_free_memory(0.99)
