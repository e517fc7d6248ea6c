"""Engine-side state of one request (plain Python; no torch)."""

from __future__ import annotations

import enum
from typing import Optional

import time

from pagedllm.messages.engine_core import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest, FinishReason
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Ordered so that "is finished" is one comparison."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # structured outputs: its grammar compiles in the background
    WAITING_FOR_REMOTE_KVS = 2  # its prefix hits are loaded from the second KV tier
    RUNNING = 3
    PREEMPTED = 4
    # Everything after this point is finished.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> Optional[FinishReason]:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """A request as the scheduler sees it.

    ``all_token_ids`` is the prompt followed by the generated tokens. The tokens still to
    compute are ``num_tokens - num_computed_tokens``: there is no separate prefill or
    decode phase. ``block_hashes`` holds the hash of every *full* block of
    ``all_token_ids`` (prefix caching), extended as tokens are appended. ``mm_features``:
    the prompt's images (``MultiModalFeatureSpec``, prompt order; empty: none), whose
    embeddings the encoder computes before their placeholder tokens run.
    """

    def __init__(self, request: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = request.request_id
        self.sampling_params: SamplingParams = request.sampling_params
        self.eos_token_id = request.eos_token_id
        self.arrival_time = request.arrival_time
        self.priority = request.priority
        self.cache_salt = request.cache_salt
        self.lora_request = request.lora_request
        #: The adapter's identity (``LoRARequest.adapter_key``), None for the base model.
        self.lora_key = None if request.lora_request is None else request.lora_request.adapter_key
        self.mm_features = list(request.mm_features or ())
        self.prompt_token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        max_tokens = self.sampling_params.max_tokens
        room = max_model_len - self.num_prompt_tokens
        self.max_tokens = room if max_tokens is None else min(max_tokens, room)
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int] = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set once, at first scheduling
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        # Speculative decoding: draft tokens proposed for the next step (vLLM's name).
        self.spec_token_ids: list[int] = []
        # Index of the next prompt token whose logprob the front end has not received
        # (token 0 has none).
        self.num_prompt_logprobs_sent = 1
        # QUEUED / SCHEDULED / PREEMPTED timestamps not yet sent to the front end (metrics).
        self.events: list[EngineCoreEvent] = []
        self.record_event(EngineCoreEventType.QUEUED)
        # Structured outputs: the constraint and its grammar (set by the scheduler).
        self.structured_output_request: Optional[StructuredOutputRequest] = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def record_event(self, event_type: EngineCoreEventType, timestamp: Optional[float] = None) -> None:
        self.events.append(EngineCoreEvent(event_type, time.time() if timestamp is None else timestamp))

    def take_events(self) -> Optional[list[EngineCoreEvent]]:
        """The events recorded since the last call (None if there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def get_finished_reason(self) -> Optional[FinishReason]:
        return RequestStatus.get_finished_reason(self.status)
