"""Blocks as bytes (``KVBlockLayout``) and the second tier's worker: snapshots before reuse, loads
written by its thread, RAM and disk stores."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.distributed.kv_transfer.kv_blocks import KVBlockLayout, block_dim
from pagedllm.distributed.kv_transfer.offloading import DiskBlockStore, HostBlockStore, OffloadingWorker
from pagedllm.messages.sched_output import DROP, LOAD, STORE, KVTransfer


def caches() -> tuple[list[torch.Tensor], list[int]]:
    """A paged [2, blocks, 4, 2, 8] float32 cache, an MLA-like [blocks, 4, 12] bfloat16 one and an
    FP8 one: 6 blocks each."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2, 6, 4, 2, 8, generator=gen), torch.randn(6, 4, 12, generator=gen).bfloat16(),
               torch.randn(2, 6, 4, 2, 8, generator=gen).to(torch.float8_e4m3fn)]
    return tensors, [1, 0, 1]


def test_block_dim_from_the_backend_shape():
    assert block_dim(lambda n: (2, n, 16, 2, 64)) == 1
    assert block_dim(lambda n: (n, 16, 576)) == 0
    with pytest.raises(ValueError, match="one block dimension"):
        block_dim(lambda n: (2, 16))


def test_gather_then_scatter_moves_whole_blocks_of_every_tensor():
    tensors, dims = caches()
    layout = KVBlockLayout(tensors, dims)
    assert layout.block_bytes == 2 * 4 * 2 * 8 * 4 + 4 * 12 * 2 + 2 * 4 * 2 * 8
    rows = layout.gather([4, 1])
    before = [t.clone() for t in tensors]
    layout.scatter([0, 5], rows)
    for t, b, d in zip(tensors, before, dims):
        assert torch.equal(t.select(d, 0).view(torch.uint8), b.select(d, 4).view(torch.uint8))
        assert torch.equal(t.select(d, 5).view(torch.uint8), b.select(d, 1).view(torch.uint8))
        assert torch.equal(t.select(d, 2).view(torch.uint8), b.select(d, 2).view(torch.uint8))
    with pytest.raises(ValueError, match="uint8 rows"):
        layout.scatter([0], rows)


@pytest.mark.parametrize("where", ["ram", "disk"])
def test_a_stored_block_keeps_its_bytes_after_reuse_and_loads_back(tmp_path, where):
    tensors, dims = caches()
    layout = KVBlockLayout(tensors, dims)
    store = DiskBlockStore(str(tmp_path), rank=1) if where == "disk" else HostBlockStore()
    worker = OffloadingWorker(layout, store)
    original = layout.gather([2])
    worker.submit([KVTransfer(STORE, b"k2", 2), KVTransfer(STORE, b"k3", 3)])
    for t, d in zip(tensors, dims):  # the step's forward reuses blocks 2 and 3 right after submit
        t.view(torch.uint8).select(d, 2).fill_(0)
    worker.submit([KVTransfer(LOAD, b"k2", 5, "r"), KVTransfer(DROP, b"k3")])
    worker.wait_for(["r"])
    assert worker.get_finished() == {"r"} and worker.get_finished() == set() and not worker.has_pending()
    assert torch.equal(layout.gather([5]), original)
    assert len(store) == 1  # k3 dropped
    if where == "disk":
        assert os.path.basename(store.directory).startswith("pagedllm-kv-rank1-")
    worker.submit([KVTransfer(LOAD, b"k3", 0, "q")])  # a key dropped: the thread's error surfaces
    with pytest.raises(RuntimeError, match="copy thread failed"):
        worker.wait_for(["q"])
    worker.close()  # closes the store: no block, no directory left
    assert len(store) == 0 if where == "ram" else not os.path.exists(store.directory)
    worker.close()
