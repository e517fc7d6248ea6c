"""Which cores each CPU worker process is pinned to (``PAGEDLLM_CPU_OMP_THREADS_BIND``), the
start-up refusal of more workers than cores, and the all-reduce choice."""

from __future__ import annotations

import pytest

from pagedllm.platforms import cpu as cpu_platform
from pagedllm.platforms import cpu_binding
from pagedllm.platforms.cpu import CpuPlatform


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(cpu_binding, "available_cores", lambda: [2, 3, 4, 5, 6, 7, 8, 9])
    monkeypatch.setattr(cpu_platform, "available_cores", lambda: [2, 3, 4, 5, 6, 7, 8, 9])


def test_auto_splits_the_cores_into_disjoint_consecutive_sets(eight_cores, monkeypatch):
    monkeypatch.delenv(cpu_binding.BIND_ENV, raising=False)
    assert [cpu_binding.cores_for_rank(r, 2) for r in range(2)] == [[2, 3, 4, 5], [6, 7, 8, 9]]
    assert [cpu_binding.cores_for_rank(r, 3) for r in range(3)] == [[2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"9 worker processes .* need at least one CPU core each, but this process may use 8"):
        cpu_binding.cores_for_rank(0, 9)


def test_explicit_lists_and_nobind(monkeypatch):
    monkeypatch.setenv(cpu_binding.BIND_ENV, "0-3|4,6")
    assert cpu_binding.cores_for_rank(0, 2) == [0, 1, 2, 3]
    assert cpu_binding.cores_for_rank(1, 2) == [4, 6]
    with pytest.raises(ValueError, match="gives 2 core lists for 4 worker processes"):
        cpu_binding.cores_for_rank(0, 4)
    monkeypatch.setenv(cpu_binding.BIND_ENV, "0-x|1")
    with pytest.raises(ValueError, match="'0-x' is not a core list"):
        cpu_binding.cores_for_rank(0, 2)
    monkeypatch.setenv(cpu_binding.BIND_ENV, "nobind")
    assert cpu_binding.cores_for_rank(1, 2) is None


def test_more_workers_than_cores_is_a_start_up_error(eight_cores, monkeypatch):
    monkeypatch.delenv(cpu_binding.BIND_ENV, raising=False)
    CpuPlatform().check_worker_count(8)
    with pytest.raises(ValueError, match=r"= 16 worker processes need at least one CPU core each, but this process may use 8 core"):
        CpuPlatform().check_worker_count(16)


def test_all_reduce_choice(monkeypatch):
    monkeypatch.setenv(cpu_platform.COLLECTIVES_ENV, "gloo")
    assert not CpuPlatform().use_shared_memory_collectives()
    monkeypatch.setenv(cpu_platform.COLLECTIVES_ENV, "shm")
    assert CpuPlatform().use_shared_memory_collectives()
    monkeypatch.setenv(cpu_platform.COLLECTIVES_ENV, "nccl")
    with pytest.raises(ValueError, match="'nccl': use shm or gloo"):
        CpuPlatform().use_shared_memory_collectives()
