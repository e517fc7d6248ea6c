"""``CudaPlatform.check_free_memory``: vLLM's start-up check that the share of the GPU the
engine will take (``gpu_memory_utilization`` x total) is free; the device query is stubbed,
so this runs without a GPU."""

from __future__ import annotations

import pytest
import torch

from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cuda import CudaPlatform

GIB = 2**30


def _gpu(monkeypatch, free_gib, cached_unused_gib=0):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: (5 + cached_unused_gib) * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 * GIB)


def test_enough_free_memory_passes(monkeypatch):
    _gpu(monkeypatch, 100)
    CudaPlatform().check_free_memory(0.7)


def test_memory_cached_by_this_process_counts_as_free(monkeypatch):
    _gpu(monkeypatch, 10, cached_unused_gib=120)  # an earlier engine's KV cache, freed
    CudaPlatform().check_free_memory(0.9)
    _gpu(monkeypatch, 10, cached_unused_gib=100)
    with pytest.raises(ValueError, match="110.00 of 140.00 GiB"):
        CudaPlatform().check_free_memory(0.9)


def test_memory_held_elsewhere_is_a_clear_error(monkeypatch):
    _gpu(monkeypatch, 100)
    with pytest.raises(ValueError) as err:
        CudaPlatform().check_free_memory(0.9)
    message = str(err.value)
    assert "100.00 of 140.00 GiB" in message and "126.00 GiB" in message and "--gpu-memory-utilization" in message


def test_cpu_reserves_nothing():
    CpuPlatform().check_free_memory(0.99)
