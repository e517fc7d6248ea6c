"""``DPRouter``: which data-parallel engine replica serves a new request (vLLM's internal load
balancing for ``--data-parallel-size``), with prefix-cache affinity.

Load is counted in the front end, exactly and without lag: a replica's load is the number
of engine requests routed to it and not finished or aborted yet (its waiting + running
requests, as vLLM balances on). A new request goes to the least loaded replica (ties: the
lowest index), except for prefix-cache affinity: a prompt whose first KV-cache block is full
goes where the last prompt with the same first block went (same token ids, cache salt and
LoRA adapter: what the block hash chains from), so prompts sharing a prefix meet their cached
blocks, while that replica's load is within ``PREFIX_AFFINITY_MARGIN`` requests of the least
loaded one; beyond that the request goes to the least loaded replica (which the prefix then
follows), so one hot prefix never piles up on one replica. Each replica has its own KV cache:
a prefix cached on one is a miss on the others. The last ``PREFIX_MEMORY`` first blocks are
remembered (least recently routed forgotten first).

Plain Python, no I/O: ``DPAsyncMPClient`` (``dp_client``) calls it.
"""

from __future__ import annotations

import collections
from typing import Optional

from pagedllm.messages.engine_core import EngineCoreRequest

#: How many more requests than the least loaded replica the replica holding a prompt's first
#: block may have and still get the prompt.
PREFIX_AFFINITY_MARGIN = 2
#: First blocks remembered for affinity.
PREFIX_MEMORY = 4096

PrefixKey = tuple[tuple[int, ...], Optional[str], int]


class DPRouter:
    """Routes requests to ``num_replicas`` replicas (see the module docstring).

    Args:
        num_replicas: data-parallel replicas (>= 1).
        block_size: KV-cache block size in tokens (the prefix-affinity key is the first block).
        affinity_margin: see ``PREFIX_AFFINITY_MARGIN``.

    Attributes:
        loads: unfinished engine requests per replica.
    """

    def __init__(self, num_replicas: int, block_size: int, affinity_margin: int = PREFIX_AFFINITY_MARGIN) -> None:
        self.loads = [0] * num_replicas
        self.block_size = block_size
        self.affinity_margin = affinity_margin
        self._replica_of: dict[str, int] = {}
        self._prefix_replica: collections.OrderedDict[PrefixKey, int] = collections.OrderedDict()

    def route(self, request: EngineCoreRequest) -> int:
        """Choose the replica for ``request`` and count it there; returns its index."""
        rank = min(range(len(self.loads)), key=self.loads.__getitem__)
        key = self._prefix_key(request)
        if key is not None:
            cached = self._prefix_replica.pop(key, None)
            if cached is not None and self.loads[cached] <= self.loads[rank] + self.affinity_margin:
                rank = cached
            self._prefix_replica[key] = rank
            if len(self._prefix_replica) > PREFIX_MEMORY:
                self._prefix_replica.popitem(last=False)
        self.loads[rank] += 1
        self._replica_of[request.request_id] = rank
        return rank

    def _prefix_key(self, request: EngineCoreRequest) -> Optional[PrefixKey]:
        """What a prompt's first block's hash chains from; None when the block is not full."""
        tokens = request.prompt_token_ids
        if len(tokens) < self.block_size:
            return None
        adapter = request.lora_request.lora_int_id if request.lora_request is not None else 0
        return tuple(tokens[: self.block_size]), request.cache_salt, adapter

    def replica_of(self, request_id: str) -> Optional[int]:
        """The replica serving ``request_id``, or None once it finished (or was never routed)."""
        return self._replica_of.get(request_id)

    def finish(self, request_id: str) -> Optional[int]:
        """Forget a finished or aborted request; returns its replica (None if unknown:
        finishing twice is harmless)."""
        rank = self._replica_of.pop(request_id, None)
        if rank is not None:
            self.loads[rank] -= 1
        return rank
