"""All-reduce and all-gather through shared memory, for the tensor-parallel ranks of one
CPU machine.

gloo's collectives go through TCP loopback sockets: for the small messages of a decode
step (a few rows of hidden size; a few rows of this rank's logits) their fixed cost
dominates. Here the ranks share one mapping of a ``/dev/shm`` file instead::

    flags  [world, 8] int64     rank r's sequence number in flags[r, 0] (own cache line)
    slots  [2, world, capacity] two sets (alternating calls), one slot per rank

Call ``s`` of a rank: copy its input into ``slots[s % 2, rank]``, store ``s`` in its flag,
wait until every flag is at least ``s``, then sum the slots in rank order (all-reduce: so
every rank gets bit-identical sums) or copy them out in rank order (all-gather). A rank can write set ``s % 2`` again only at call ``s + 2``,
after every rank has flagged ``s + 1`` and so finished reading call ``s``: no second
barrier is needed. Inputs larger than a slot go through in slot-sized pieces.

NOTE: the data copy must be visible to the other ranks before the flag: x86-64 keeps stores
in order (TSO), which ``CpuPlatform.use_shared_memory_all_reduce`` requires by default.

Measured against gloo with ``benchmarks/all_reduce_bench.py`` (2 ranks pinned to one core
each, float32 [rows, 896], median per call): 1 row 44 vs 357 us, 8 rows 54 vs 339 us,
32 rows 75 vs 355 us, 256 rows 383 vs 2,338 us (shared memory vs gloo).
"""

from __future__ import annotations

import mmap
import os
import uuid
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

#: Bytes of one rank's slot; larger inputs go through in pieces (a decode step's message
#: is rows x hidden x 4 bytes: 32 x 896 x 4 = 112 KiB).
SLOT_BYTES = 4 << 20
_FLAG_BYTES = 64
#: Busy-wait polls before each ``sched_yield`` (ranks may share cores with other work).
_SPINS_BEFORE_YIELD = 64
#: Busy-wait polls between checks that the other ranks' processes still exist.
_SPINS_BEFORE_LIVENESS_CHECK = 1 << 14


class ShmCommunicator:
    """The shared-memory collectives of one group of processes on one machine.

    Building it is collective: every rank of the group calls it at the same point (rank
    ``ranks[0]`` creates the file, tells the others its name over ``group``, and removes the
    name once all have mapped it, so nothing is left behind even if a process is killed).

    Args:
        group: the group's ``torch.distributed`` process group (gloo).
        ranks: its global ranks, in group order; this process's rank is among them.
        slot_bytes: capacity of each rank's slot in bytes.
    """

    def __init__(self, group: dist.ProcessGroup, ranks: list[int], slot_bytes: int = SLOT_BYTES) -> None:
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(dist.get_rank())
        self.slot_bytes = slot_bytes
        size = _FLAG_BYTES * self.world_size + 2 * self.world_size * slot_bytes
        name = [f"/dev/shm/pagedllm-all-reduce-{uuid.uuid4().hex}" if self.rank_in_group == 0 else None]
        if self.rank_in_group == 0:
            with open(name[0], "wb") as f:
                f.truncate(size)
        dist.broadcast_object_list(name, src=ranks[0], group=group)
        self._pids: list[int] = [0] * self.world_size
        dist.all_gather_object(self._pids, os.getpid(), group=group)
        with open(name[0], "r+b") as f:
            self._mmap = mmap.mmap(f.fileno(), size)
        dist.barrier(group=group)
        if self.rank_in_group == 0:
            os.unlink(name[0])
        buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        self._flags = buffer[: _FLAG_BYTES * self.world_size].view(np.int64).reshape(self.world_size, -1)[:, 0]
        self._slots = torch.from_numpy(buffer[_FLAG_BYTES * self.world_size :]).view(2, self.world_size, slot_bytes)
        self._seq = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``x`` over the group: a new tensor of ``x``'s shape and
        dtype, bit-identical on every rank."""
        flat = x.reshape(-1)
        out = torch.empty_like(flat)
        for start, slots in self._exchange(flat):
            piece = out[start : start + slots.shape[1]]
            torch.add(slots[0], slots[1], out=piece)
            for r in range(2, self.world_size):
                piece.add_(slots[r])
        return out.view(x.shape)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The group's ``x`` (same shape and dtype on every rank) concatenated along ``dim``
        in rank order."""
        flat = x.reshape(-1)
        parts = torch.empty((self.world_size, flat.numel()), dtype=x.dtype)
        for start, slots in self._exchange(flat):
            parts[:, start : start + slots.shape[1]] = slots
        return torch.cat([part.view(x.shape) for part in parts], dim=dim)

    def _exchange(self, flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """For each slot-sized piece of ``flat`` (1-D): publish it, wait for every rank's,
        and yield (its offset, the ranks' pieces [world, piece length] in shared memory,
        to be read before the next piece)."""
        capacity = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), capacity):
            piece = flat[start : start + capacity]
            self._seq += 1
            slots = self._slots[self._seq % 2].view(piece.dtype)[:, : piece.numel()]
            slots[self.rank_in_group].copy_(piece)
            self._flags[self.rank_in_group] = self._seq
            self._wait_for_all(self._seq)
            yield start, slots

    def _wait_for_all(self, seq: int) -> None:
        """Spin until every rank has flagged call ``seq``.

        Raises:
            RuntimeError: another rank's process no longer exists (it would never flag).
        """
        flags = self._flags
        spins = 0
        while flags.min() < seq:
            spins += 1
            if spins % _SPINS_BEFORE_YIELD == 0:
                os.sched_yield()
            if spins % _SPINS_BEFORE_LIVENESS_CHECK == 0:
                self._check_peers_alive(seq)

    def _check_peers_alive(self, seq: int) -> None:
        for rank, pid in enumerate(self._pids):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError(
                    f"Rank {rank} (pid {pid}) of the shared-memory group exited before its collective {seq}."
                ) from None

    def close(self) -> None:
        """Unmap the buffer (after the group's last call); idempotent."""
        if self._mmap is not None:
            self._slots = self._flags = None  # type: ignore[assignment]
            try:
                self._mmap.close()
            except BufferError:  # a tensor returned earlier still views it: freed with it
                pass
            self._mmap = None
