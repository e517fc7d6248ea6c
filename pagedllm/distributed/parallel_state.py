"""The model-parallel groups of the worker processes and their collectives.

A model split over ``world_size = tp x pp`` worker processes (tensor and pipeline
parallelism) has its ranks laid out as vLLM's::

    rank = pp_rank x tp + tp_rank        e.g. tp = 2, pp = 2:   TP groups [0, 1], [2, 3]
                                                               PP groups [0, 2], [1, 3]

Each worker calls ``init_distributed_environment`` (joins ``torch.distributed`` over a
``tcp://`` address, on the platform's backend: gloo on CPU, NCCL on CUDA) and then
``initialize_model_parallel`` (builds every TP and PP group; each process keeps its own).
A single process needs neither: ``initialize_model_parallel(1)`` alone makes groups of one,
whose collectives return their input.

The collectives (``tensor_model_parallel_all_reduce`` / ``_all_gather``) are timed:
``get_comm_stats`` returns calls, bytes and seconds per operation (``pagedllm bench``
prints them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from pagedllm.distributed.shm_communicator import ShmCommunicator
from pagedllm.platforms import current_platform


@dataclass
class CommStats:
    """One collective's totals in this process: calls, bytes of input, seconds spent."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


_comm_stats: dict[str, CommStats] = {}


def get_comm_stats() -> dict[str, CommStats]:
    """Operation name (``"all_reduce"``, ``"all_gather"``, ``"send"``, ``"recv"``) -> its totals since the start or
    the last ``reset_comm_stats``; only collectives over more than one rank count."""
    return dict(_comm_stats)


def reset_comm_stats() -> None:
    _comm_stats.clear()


def _record(op: str, x: torch.Tensor, start: float) -> None:
    stats = _comm_stats.setdefault(op, CommStats())
    stats.calls += 1
    stats.bytes += x.numel() * x.element_size()
    stats.seconds += time.perf_counter() - start


class GroupCoordinator:
    """One model-parallel group as this process sees it.

    Args:
        ranks: the group's global ranks, in group order.
        rank: this process's global rank (one of ``ranks``).
        device_group: the ``torch.distributed`` group (None for a group of one).
        shm: the shared-memory collectives of this group (CPU), or None to communicate
            through ``device_group``.
    """

    def __init__(
        self, ranks: list[int], rank: int, device_group: Optional[dist.ProcessGroup] = None,
        shm: Optional[ShmCommunicator] = None,
    ) -> None:
        self.ranks = ranks
        self.rank = rank
        self.rank_in_group = ranks.index(rank)
        self.world_size = len(ranks)
        self.device_group = device_group
        self.shm = shm
        # (work, tensor) of the sends ``send_tensor_dict`` started and nobody waited for yet.
        self._pending_sends: list[tuple[dist.Work, torch.Tensor]] = []

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``x`` over the group (same shape and dtype; ``x`` itself
        in a group of one). Every rank gets bit-identical values. ``x`` must not be used
        afterwards: gloo and NCCL reduce in its storage."""
        if self.world_size == 1:
            return x
        start = time.perf_counter()
        if self.shm is not None:
            out = self.shm.all_reduce(x)
        else:
            out = x.contiguous()
            dist.all_reduce(out, group=self.device_group)
        _record("all_reduce", x, start)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The group's ``x`` (equal shapes) concatenated along ``dim`` in rank order."""
        if self.world_size == 1:
            return x
        start = time.perf_counter()
        if self.shm is not None:
            out = self.shm.all_gather(x, dim)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x.contiguous(), group=self.device_group)
            out = torch.cat(parts, dim=dim)
        _record("all_gather", x, start)
        return out

    # Pipeline parallelism: point-to-point between neighbouring stages.
    def send_tensor_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start sending ``tensors`` (e.g. ``{"hidden_states", "residual"}``, each [T, hidden])
        to the next rank of the group, in key order, and return without waiting for them
        (``isend``): the stage can run its next step while the next stage is still busy.
        The sends of the previous call are waited for first, so at most one step's tensors
        are in transit; its ``recv_tensor_dict`` must expect the same keys, shapes and dtypes.
        The "send" stats count the bytes posted and the seconds spent posting and waiting."""
        self.wait_sends()
        dst = self.ranks[self.rank_in_group + 1]
        for name in sorted(tensors):
            start = time.perf_counter()
            tensor = tensors[name].contiguous()
            self._pending_sends.append((dist.isend(tensor, dst=dst, group=self.device_group), tensor))
            _record("send", tensor, start)

    def wait_sends(self) -> None:
        """Wait until the tensors of the last ``send_tensor_dict`` are sent."""
        if not self._pending_sends:
            return
        start = time.perf_counter()
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()
        _comm_stats.setdefault("send", CommStats()).seconds += time.perf_counter() - start

    def recv_tensor_dict(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> dict[str, torch.Tensor]:
        """The tensors the previous rank of the group sent with ``send_tensor_dict``:
        ``specs`` maps each name to its (shape, dtype)."""
        src = self.ranks[self.rank_in_group - 1]
        out = {}
        for name in sorted(specs):
            start = time.perf_counter()
            shape, dtype = specs[name]
            out[name] = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(out[name], src=src, group=self.device_group)
            _record("recv", out[name], start)
        return out

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None


_tp_group: Optional[GroupCoordinator] = None
_pp_group: Optional[GroupCoordinator] = None
_dp_group: Optional[GroupCoordinator] = None
_expert_parallel = False


def init_distributed_environment(
    world_size: int, rank: int, distributed_init_method: str, local_rank: int = 0, backend: Optional[str] = None
) -> None:
    """Join the ``world_size`` worker processes of one model as global ``rank`` (once per
    process; a second call with the same world size does nothing).

    Args:
        world_size: tensor_parallel_size x pipeline_parallel_size.
        rank: this process's rank, 0 .. world_size - 1.
        distributed_init_method: where rank 0 listens, ``tcp://host:port``.
        local_rank: this process's rank among the workers on its machine (its GPU, its cores).
        backend: ``torch.distributed`` backend; None: the platform's (gloo / nccl).

    Raises:
        ValueError: a rank outside the world, or a different world size than a previous call.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} processes.")
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"torch.distributed is already initialized with world size {dist.get_world_size()}, not {world_size}."
            )
        return
    dist.init_process_group(
        backend=backend or current_platform.dist_backend, init_method=distributed_init_method,
        world_size=world_size, rank=rank,
    )


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              enable_expert_parallel: bool = False, data_parallel_size: int = 1) -> None:
    """Build the tensor- and pipeline-parallel groups (ranks laid out as in the module
    docstring). Without ``torch.distributed`` (one process) both must be 1: groups of one.
    On CPU with shared-memory collectives chosen (``Platform.use_shared_memory_collectives``)
    each TP group gets a ``ShmCommunicator``. ``enable_expert_parallel``: mixture-of-experts
    layers place whole experts over the TP group (``expert_parallel_enabled``).
    ``data_parallel_size`` > 1: the world holds that many data-parallel engines of one rank
    each (tp = pp = 1; ``-dp N --enable-expert-parallel``), joined in one data-parallel group
    (``get_dp_group``: rank = the engine's ``data_parallel_rank``) over which the experts are spread.

    Raises:
        ValueError: a size below 1, tp x pp x dp different from the world size, or a
            data-parallel group with tp or pp above 1.
    """
    global _tp_group, _pp_group, _dp_group
    tp, pp, dp = tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size
    if tp < 1 or pp < 1 or dp < 1:
        raise ValueError(f"tensor_model_parallel_size ({tp}), pipeline_model_parallel_size ({pp}) and "
                         f"data_parallel_size ({dp}) must be at least 1.")
    if dp > 1 and tp * pp > 1:
        raise ValueError(f"A data-parallel group of {dp} engines needs tp = pp = 1 (got tp {tp}, pp {pp}).")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if tp * pp * dp != world_size:
        what = f"tensor_model_parallel_size {tp} x pipeline_model_parallel_size {pp}"
        raise ValueError(
            f"{what}{f' x data_parallel_size {dp}' if dp > 1 else ''} != world size {world_size} "
            f"(init_distributed_environment first for more than one process)."
        )
    destroy_model_parallel()
    global _expert_parallel
    _expert_parallel = enable_expert_parallel
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dp > 1:
        _tp_group = _pp_group = GroupCoordinator([rank], rank)
        _dp_group = GroupCoordinator(list(range(dp)), rank, dist.group.WORLD)
        return
    use_shm = world_size > 1 and current_platform.use_shared_memory_collectives()
    # Every process creates every group, in the same order (torch.distributed requires it).
    for ranks in ([p * tp + t for t in range(tp)] for p in range(pp)):
        group = _new_group(ranks)
        if rank in ranks:
            shm = ShmCommunicator(group, ranks) if use_shm and tp > 1 else None
            _tp_group = GroupCoordinator(ranks, rank, group, shm)
    for ranks in ([p * tp + t for p in range(pp)] for t in range(tp)):
        group = _new_group(ranks)
        if rank in ranks:
            _pp_group = GroupCoordinator(ranks, rank, group)


def _new_group(ranks: list[int]) -> Optional[dist.ProcessGroup]:
    if not dist.is_initialized():
        return None
    return dist.new_group(ranks, backend=current_platform.dist_backend)


def destroy_model_parallel() -> None:
    """Forget the groups (releasing the shared-memory buffer); idempotent."""
    global _tp_group, _pp_group, _dp_group, _expert_parallel
    if _tp_group is not None:
        _tp_group.destroy()
    _tp_group = _pp_group = _dp_group = None
    _expert_parallel = False


def destroy_distributed_environment() -> None:
    """Destroy the groups and leave ``torch.distributed``; idempotent."""
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _group(group: Optional[GroupCoordinator]) -> GroupCoordinator:
    return group if group is not None else GroupCoordinator([0], 0)


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group (a group of one before ``initialize_model_parallel``)."""
    return _group(_tp_group)


def get_pp_group() -> GroupCoordinator:
    """This process's pipeline-parallel group (a group of one before ``initialize_model_parallel``)."""
    return _group(_pp_group)


def get_dp_group() -> GroupCoordinator:
    """This process's data-parallel group: the engines of ``-dp N --enable-expert-parallel``
    (a group of one otherwise)."""
    return _group(_dp_group)


def expert_parallel_enabled() -> bool:
    """Whether mixture-of-experts layers hold whole experts per TP rank (``--enable-expert-parallel``)
    rather than a slice of every expert."""
    return _expert_parallel


def get_tensor_model_parallel_world_size() -> int:
    """Processes in the tensor-parallel group."""
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in the tensor-parallel group, from 0."""
    return get_tp_group().rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    """Stages in the pipeline-parallel group."""
    return get_pp_group().world_size


def get_pipeline_model_parallel_rank() -> int:
    """This process's stage, from 0."""
    return get_pp_group().rank_in_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel ranks (same shape and dtype): ``x`` itself
    in a group of one."""
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The tensor-parallel ranks' ``x`` concatenated along ``dim`` in rank order: ``x``
    itself in a group of one."""
    return get_tp_group().all_gather(x, dim)
