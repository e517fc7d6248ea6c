"""Which cores each worker process of one machine runs on (CPU tensor / pipeline parallelism).

Each rank is a process with its own OpenMP thread pool; pinned to disjoint cores, the pools
do not compete for the same cores (vLLM's CPU worker does the same). The choice comes from
``PAGEDLLM_CPU_OMP_THREADS_BIND`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``):

- ``auto`` (default): the cores this process may run on (``os.sched_getaffinity``), in
  order, cut into ``local_world_size`` consecutive equal sets; rank ``r`` takes set ``r``
  (cores left over by the division stay unused);
- ``nobind``: no pinning; every rank keeps the process's cores and torch's thread count;
- explicit core lists, one per rank, separated by ``|``: ``"0-3|4-7"`` or ``"0,2|1,3"``.

With data-parallel replicas of several workers (``-dp M -tp N``), ``local_world_size`` is
M x N and replica d's rank r is local rank ``d x N + r`` (``ParallelConfig.local_rank_offset``):
the automatic split gives every worker of every replica its own cores, and an explicit
setting lists M x N core lists, replica by replica (vLLM's layout).
"""

from __future__ import annotations

import os
from typing import Optional

from pagedllm import envs

BIND_ENV = envs.PAGEDLLM_CPU_OMP_THREADS_BIND.name


def bind_setting() -> str:
    """``PAGEDLLM_CPU_OMP_THREADS_BIND`` without surrounding spaces: ``auto`` (also when unset
    or blank), ``nobind``, or the core lists."""
    return envs.PAGEDLLM_CPU_OMP_THREADS_BIND.get().strip() or "auto"


def available_cores() -> list[int]:
    """The ids of the cores this process may run on, ascending."""
    return sorted(os.sched_getaffinity(0))


def parse_core_list(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``.

    Raises:
        ValueError: a malformed list.
    """
    cores: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores += range(int(first), int(last or first) + 1)
    except ValueError:
        raise ValueError(f"{BIND_ENV}: {text!r} is not a core list like '0-3' or '0,2,4'.") from None
    if not cores:
        raise ValueError(f"{BIND_ENV}: empty core list {text!r}.")
    return cores


def cores_for_rank(local_rank: int, local_world_size: int) -> Optional[list[int]]:
    """The cores worker ``local_rank`` of ``local_world_size`` is pinned to, or None
    (``nobind``: no pinning). See the module docstring.

    Raises:
        ValueError: fewer cores than ranks (``auto``), an explicit setting without one list
            per rank, or a malformed list.
    """
    setting = bind_setting()
    if setting == "nobind":
        return None
    if setting != "auto":
        lists = setting.split("|")
        if len(lists) != local_world_size:
            raise ValueError(
                f"{BIND_ENV}={setting!r} gives {len(lists)} core lists for {local_world_size} worker processes."
            )
        return parse_core_list(lists[local_rank])
    cores = available_cores()
    per_rank = len(cores) // local_world_size
    if per_rank == 0:
        raise ValueError(
            f"{local_world_size} worker processes (tensor_parallel_size x pipeline_parallel_size) need at "
            f"least one CPU core each, but this process may use {len(cores)} core(s): {cores}."
        )
    return cores[local_rank * per_rank : (local_rank + 1) * per_rank]
