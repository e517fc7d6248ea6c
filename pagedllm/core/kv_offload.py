"""The second KV tier's index, on the scheduler's side (vLLM's ``OffloadingManager``; no torch).

Blocks evicted from the prefix cache (``BlockPool``'s eviction of a hashed block) are
stored in the tier under their prefix-cache key; a prefix-cache lookup that misses in the
first tier continues here, and the hits are loaded into newly allocated blocks. The tier's
bytes live on the workers (``pagedllm.distributed.kv_transfer.offloading``); this index
decides what they hold and sends its decisions as an ordered list of ``KVTransfer`` per
step (``SchedulerOutput.kv_transfers``), which every worker applies in order::

    step N:   store(B7, h1)  store(B2, h2)  drop(h0)  load(h1 -> B5, req a)
              (B7 is read before step N's forward reuses it; h1's load follows its store)

The index is an LRU of ``num_blocks`` keys: a store beyond that drops the least recently
stored or hit key first, but never a key ``pin``ned in this step (hits about to be loaded,
while their request's blocks are allocated, which may store evicted blocks); pins last until
``take_transfers``. A key is usable as soon as its store is listed: the workers apply each
step's list in order, one step after the other.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.core.kv_cache_utils import BlockHash
from pagedllm.messages.sched_output import DROP, LOAD, STORE, KVTransfer

class OffloadingManager:
    """LRU index of the keys the second tier holds, and the step's transfers to apply.

    Args:
        num_blocks: blocks the tier holds (its size over the bytes of one block on all
            ranks); at least 1.

    Raises:
        ValueError: ``num_blocks`` below 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV offloading tier must hold at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self._keys: OrderedDict[BlockHash, None] = OrderedDict()
        self._transfers: list[KVTransfer] = []
        self._pinned: set[BlockHash] = set()
        #: Blocks stored, loaded and dropped so far (for metrics and tests).
        self.num_stored = self.num_loaded = self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._keys

    def lookup(self, block_hashes: list[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the tier holds (the leading run)."""
        num_hits = 0
        for block_hash in block_hashes:
            if block_hash not in self._keys:
                break
            num_hits += 1
        return num_hits

    def pin(self, block_hashes: list[BlockHash]) -> None:
        """Make held keys the most recent and keep them until this step's ``take_transfers``."""
        for block_hash in block_hashes:
            self._keys.move_to_end(block_hash)
            self._pinned.add(block_hash)

    def store(self, block_id: int, block_hash: BlockHash) -> None:
        """Store an evicted block under ``block_hash`` (a key held already is only made the
        most recent), dropping the least recent unpinned keys beyond ``num_blocks`` (the new
        one itself when all others are pinned)."""
        if block_hash in self._keys:
            self._keys.move_to_end(block_hash)
            return
        self._keys[block_hash] = None
        self._transfers.append(KVTransfer(STORE, block_hash, block_id))
        self.num_stored += 1
        while len(self._keys) > self.num_blocks:
            dropped = next(k for k in self._keys if k not in self._pinned)
            del self._keys[dropped]
            self._transfers.append(KVTransfer(DROP, dropped))
            self.num_dropped += 1

    def load(self, req_id: str, block_hashes: list[BlockHash], block_ids: list[int]) -> None:
        """Load the held ``block_hashes`` into ``block_ids`` for ``req_id`` (each key becomes
        the most recent).

        Raises:
            KeyError: a key the tier does not hold (``lookup`` first).
        """
        for block_hash, block_id in zip(block_hashes, block_ids, strict=True):
            self._keys.move_to_end(block_hash)
            self._transfers.append(KVTransfer(LOAD, block_hash, block_id, req_id))
        self.num_loaded += len(block_hashes)

    def clear(self) -> None:
        """Drop every key (``reset_prefix_cache``)."""
        for block_hash in self._keys:
            self._transfers.append(KVTransfer(DROP, block_hash))
        self.num_dropped += len(self._keys)
        self._keys.clear()

    def take_transfers(self) -> list[KVTransfer]:
        """The transfers decided since the last call, in order (for this step's output);
        the pins end."""
        transfers, self._transfers = self._transfers, []
        self._pinned.clear()
        return transfers
