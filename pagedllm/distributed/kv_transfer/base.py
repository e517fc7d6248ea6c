"""The KV connector interface: a scheduler side and a worker side (vLLM's
``KVConnectorBase_V1`` split).

Flow of one request split over two engines (the router's, ``pagedllm router``):

1. The producer gets it with ``kv_transfer_params={"do_remote_decode": true}`` (and
   ``max_tokens=1``). When the step that computes its last prompt token is scheduled,
   ``build_connector_meta`` lists a save; the worker side keeps the prompt's KV after
   that step's forward (``save_kv``). Its final output's ``kv_transfer_params``
   (``request_finished``) say where to fetch it.
2. The consumer gets the request with those params. At admission
   ``get_num_new_matched_tokens`` counts the prompt tokens whose KV it loads (all but the
   last, which it computes, so its first token is sampled from its own logits);
   ``build_connector_meta`` lists the load, and the worker side fills the request's blocks
   before the forward (``start_load_kv``). A load that fails aborts the request; its
   output's ``kv_transfer_params`` carries ``{"error": reason}``.

A connector that moves blocks without the workers' copies (RDMA) fits the same calls:
``KVLoadSpec`` names the destination blocks, and the producer's params can name its own.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol

from pagedllm.messages.kv_transfer import KVConnectorMetadata
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedllm.distributed.kv_transfer.layout import KVLayout
    from pagedllm.messages.sched_output import SchedulerOutput


class Request(Protocol):
    """What a connector reads of the scheduler's ``pagedllm.core.request.Request`` (the
    core sits above this layer)."""

    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    sampling_params: SamplingParams


def kv_transfer_params(request: Request) -> dict[str, Any]:
    """The request's ``kv_transfer_params`` (``SamplingParams.extra_args``); {} when none."""
    extra = request.sampling_params.extra_args or {}
    return extra.get("kv_transfer_params") or {}


class KVConnectorScheduler(abc.ABC):
    """The scheduler's half of a connector (plain Python, no torch)."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first ``num_computed_tokens`` whose KV a waiting request gets
        from a remote engine (0: none); never its last prompt token."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        """The request was admitted with blocks for its ``num_external_tokens`` remote
        tokens (after its ``num_computed_tokens``): load them before its first step."""

    @abc.abstractmethod
    def build_connector_meta(
        self, scheduler_output: "SchedulerOutput", requests: Mapping[str, Request],
        block_ids_of: Callable[[str], tuple[list[int], ...]],
    ) -> KVConnectorMetadata:
        """The step's loads and saves, once its requests' ``num_computed_tokens`` count the
        step; ``block_ids_of(req_id)`` gives a request's block table per KV-cache group."""

    @abc.abstractmethod
    def request_finished(self, request: Request) -> Optional[dict[str, Any]]:
        """The ``kv_transfer_params`` of a finished request's last output (None: none)."""

    @abc.abstractmethod
    def request_failed(self, request: Request, reason: str) -> Optional[dict[str, Any]]:
        """The ``kv_transfer_params`` of a request the runner could not serve (a failed
        load: ``{"error": reason}``; None for other requests)."""

    @abc.abstractmethod
    def request_freed(self, request_id: str) -> None:
        """Forget a request that finished (or was aborted)."""


class KVConnectorWorker(abc.ABC):
    """The worker's half of a connector: moves KV in and out of its paged cache."""

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: list["torch.Tensor"], layout: "KVLayout") -> None:
        """The worker's cache tensors, one per attention layer, and their layout (again
        after a wake-up); a connector checks a peer's layout against it before moving KV."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> dict[str, str]:
        """Fill the blocks of the step's loads before its forward; returns request id ->
        reason for each load that failed (the scheduler aborts those requests)."""

    @abc.abstractmethod
    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        """Keep the KV of the step's saves, after its forward."""

    def shutdown(self) -> None:
        """Stop serving (close sockets, threads); the default has nothing to stop."""
