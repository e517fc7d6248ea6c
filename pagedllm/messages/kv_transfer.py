"""What the scheduler tells the workers' KV connector each step (plain data, no torch).

A prefill / decode split (``pagedllm.distributed.kv_transfer``): the scheduler side of
the connector decides which requests' KV is loaded from a remote producer before this
step's forward (``loads``) and which requests' prompt KV is kept for a remote consumer
after it (``saves``); the worker side does the copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVLoadSpec:
    """Load the KV of a request's first ``num_tokens`` tokens, which producer
    ``remote_host:remote_port`` (worker rank r: port + r) keeps under
    ``remote_request_id``, into the slots of ``block_ids`` (token i: block
    ``block_ids[i // block_size]``, offset ``i % block_size``)."""

    req_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class KVSaveSpec:
    """Keep (for a consumer to fetch) the KV of a request's first ``num_tokens`` tokens,
    read from the slots of ``block_ids`` after this step's forward."""

    req_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class KVConnectorMetadata:
    """One step's KV transfers (vLLM's ``KVConnectorMetadata``)."""

    loads: list[KVLoadSpec] = field(default_factory=list)
    saves: list[KVSaveSpec] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves
