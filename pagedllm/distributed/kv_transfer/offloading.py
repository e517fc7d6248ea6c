"""The second KV tier on a worker: where evicted blocks' bytes live, and the thread that
copies them (vLLM's ``OffloadingWorker``; the scheduler's side is
``pagedllm.core.kv_offload``).

Each step's ``KVTransfer`` list is applied in order. ``submit`` snapshots the blocks to
store at once (one ``gather``, before the step's forward may overwrite a reused block) and
hands the rest to one copy thread, so the step never waits on the tier::

    step thread:  submit(step N) ── snapshot ──> forward N ─> submit(step N+1) ...
    copy thread:                  store, drop, load (read the tier, scatter into blocks)

A request whose loads are all written is reported once by ``get_finished``; ``wait_for``
blocks until given requests' loads are written (a rank whose thread is behind the one that
reported them waits there before their prefill runs).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref
from typing import Iterable, Optional, Protocol

import numpy as np
import torch

from pagedllm.distributed.kv_transfer.kv_blocks import KVBlockLayout
from pagedllm.messages.sched_output import DROP, LOAD, STORE, KVTransfer

logger = logging.getLogger(__name__)


class BlockStore(Protocol):
    """Blocks' bytes by prefix-cache key ([block_bytes] uint8 CPU tensors)."""

    def put(self, key: bytes, data: torch.Tensor) -> None: ...

    def get(self, key: bytes) -> torch.Tensor: ...

    def drop(self, key: bytes) -> None: ...

    def close(self) -> None:
        """Free every block (idempotent)."""


class HostBlockStore:
    """Blocks in host RAM (a dict of CPU tensors)."""

    def __init__(self) -> None:
        self._blocks: dict[bytes, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: bytes, data: torch.Tensor) -> None:
        self._blocks[key] = data

    def get(self, key: bytes) -> torch.Tensor:
        """Raises ``KeyError`` for a key not stored (or dropped)."""
        return self._blocks[key]

    def drop(self, key: bytes) -> None:
        self._blocks.pop(key, None)

    def close(self) -> None:
        self._blocks.clear()


class DiskBlockStore:
    """Blocks as files (one per key, raw bytes) in a new directory under ``path``, removed
    with the store (or at exit).

    Raises (constructor):
        OSError: ``path`` cannot be created or written.
    """

    def __init__(self, path: str, rank: int = 0) -> None:
        os.makedirs(path, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix=f"pagedllm-kv-rank{rank}-", dir=path)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)

    def _file(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex())

    def __len__(self) -> int:
        return len(os.listdir(self.directory))

    def put(self, key: bytes, data: torch.Tensor) -> None:
        data.numpy().tofile(self._file(key))

    def get(self, key: bytes) -> torch.Tensor:
        """Raises ``FileNotFoundError`` for a key not stored (or dropped)."""
        return torch.from_numpy(np.fromfile(self._file(key), dtype=np.uint8))

    def drop(self, key: bytes) -> None:
        try:
            os.remove(self._file(key))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._cleanup()


def make_block_store(path: Optional[str], rank: int = 0) -> BlockStore:
    """A ``DiskBlockStore`` under ``path``, or host RAM without one."""
    return DiskBlockStore(path, rank) if path else HostBlockStore()


class OffloadingWorker:
    """Applies the second tier's transfers to one worker's cache tensors.

    Args:
        layout: the worker's cache tensors (``KVBlockLayout``).
        store: where the tier's blocks live (``make_block_store``).
    """

    def __init__(self, layout: KVBlockLayout, store: BlockStore) -> None:
        self.layout = layout
        self.store = store
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._pending: dict[str, int] = {}  # request id -> its loads not yet written
        self._finished: set[str] = set()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-offload", daemon=True)
        self._thread.start()

    def submit(self, transfers: list[KVTransfer]) -> None:
        """Queue a step's transfers (in order), after snapshotting the blocks it stores."""
        if not transfers:
            return
        stores = [t.block_id for t in transfers if t.kind == STORE]
        snapshot = self.layout.gather(stores) if stores else None
        with self._lock:
            for t in transfers:
                if t.kind == LOAD:
                    self._pending[t.req_id] = self._pending.get(t.req_id, 0) + 1
        self._jobs.put((transfers, snapshot))

    def has_pending(self) -> bool:
        """Whether some request's loads are not all written."""
        with self._lock:
            return bool(self._pending)

    def get_finished(self, timeout: float = 0.0) -> set[str]:
        """The requests whose loads were all written since the last call; with ``timeout``
        (seconds), waits that long for one when there is none yet but some are pending.

        Raises:
            RuntimeError: the copy thread failed (its error is the cause).
        """
        with self._lock:
            if not self._finished and self._pending and timeout > 0:
                self._lock.wait(timeout)
            self._raise_error()
            finished, self._finished = self._finished, set()
        return finished

    def wait_for(self, req_ids: Iterable[str]) -> None:
        """Block until none of ``req_ids`` has loads left to write.

        Raises:
            RuntimeError: the copy thread failed.
        """
        req_ids = list(req_ids)
        with self._lock:
            while self._error is None and any(r in self._pending for r in req_ids):
                self._lock.wait()
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("The KV offloading copy thread failed.") from self._error

    def close(self) -> None:
        """Stop the copy thread after the queued work, then close the store (a
        ``DiskBlockStore``'s directory is removed); idempotent."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self.store.close()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                with torch.inference_mode():
                    self._apply(*job)
            except BaseException as exc:  # reported to the step thread
                logger.exception("KV offloading transfer failed")
                with self._lock:
                    self._error = exc
                    self._lock.notify_all()
                return

    def _apply(self, transfers: list[KVTransfer], snapshot: Optional[torch.Tensor]) -> None:
        """Stores and drops in order; the loads read the tier where they stand in the list,
        then are written to their blocks together."""
        host = snapshot.cpu() if snapshot is not None else None
        num_stored = 0
        load_ids: list[int] = []
        load_rows: list[torch.Tensor] = []
        load_reqs: list[str] = []
        for t in transfers:
            if t.kind == STORE:
                assert host is not None
                self.store.put(t.block_hash, host[num_stored].clone())
                num_stored += 1
            elif t.kind == DROP:
                self.store.drop(t.block_hash)
            else:
                load_ids.append(t.block_id)
                load_rows.append(self.store.get(t.block_hash))
                load_reqs.append(t.req_id)
        if load_ids:
            self.layout.scatter(load_ids, torch.stack(load_rows))
        with self._lock:
            for req_id in load_reqs:
                self._pending[req_id] -= 1
                if not self._pending[req_id]:
                    del self._pending[req_id]
                    self._finished.add(req_id)
            if load_reqs:
                self._lock.notify_all()
