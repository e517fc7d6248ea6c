"""Messages between the front end (``LLMEngine`` / ``AsyncLLM``) and the ``EngineCore``.

They are msgspec Structs so the EngineCore can run in the same process or in another one
(ZeroMQ + msgspec) without either side changing.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import msgspec

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeatureSpec
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished. ``str()`` gives the OpenAI ``finish_reason`` string."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class EngineCoreRequest(
    msgspec.Struct, array_like=True, omit_defaults=True  # type: ignore[call-arg]
):
    """A tokenized, validated request, as the EngineCore receives it.

    ``eos_token_id`` is None when the tokenizer has none. ``arrival_time`` is a
    ``time.time()`` value in seconds. ``cache_salt`` isolates the request's prefix-cache
    entries from requests with another salt. ``lora_request``: the adapter it runs with
    (``load_generation`` set by the front end), or None for the base model.
    ``pooling_params``: set on a pooling model's requests (their ``sampling_params`` are
    unused); the engine pools every request of a pooling model alike, the front end applies them.
    ``mm_features``: the prompt's images, in prompt order (None: none), their placeholder tokens
    in ``prompt_token_ids``.
    ``priority``: with the ``priority`` scheduling policy, lower runs first (vLLM's field; 0 by default).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    arrival_time: float
    cache_salt: Optional[str] = None
    lora_request: Optional[LoRARequest] = None
    pooling_params: Optional[PoolingParams] = None
    mm_features: Optional[list[MultiModalFeatureSpec]] = None
    priority: int = 0


class EngineCoreEventType(enum.IntEnum):
    """A request's scheduling event in the EngineCore (for queue / prefill time metrics)."""

    QUEUED = 1  # the EngineCore received the request
    SCHEDULED = 2  # the scheduler gave it tokens (first time, or again after preemption)
    PREEMPTED = 3  # its blocks were freed; it waits to be recomputed


class EngineCoreEvent(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """One scheduling event; ``timestamp`` is ``time.time()`` seconds in the engine process."""

    type: EngineCoreEventType
    timestamp: float


class LogprobsLists(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """Logprobs of several positions, as plain lists (cheap to serialise).

    For position ``i``: ``token_ids[i][0]`` is the sampled (or actual prompt) token and
    ``token_ids[i][1:]`` the top-k tokens in descending order; ``logprobs[i][j]`` is the
    natural-log probability of ``token_ids[i][j]``; ``ranks[i]`` is the 1-based rank of
    ``token_ids[i][0]`` in the vocabulary.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(
    msgspec.Struct, array_like=True, omit_defaults=True  # type: ignore[call-arg]
):
    """What one step produced for one request.

    ``new_token_ids`` are the tokens generated this step (empty for a prefill chunk that
    did not finish the prompt). ``new_prompt_logprobs`` covers the prompt positions
    computed this step (the first prompt position is skipped: it has no logprob).
    ``finish_reason`` is set on the last output of a request; ``stop_reason`` is the
    stop token id that ended it (None for EOS or length). ``events`` are the request's
    scheduling events since its previous output (oldest first), or None; set by the
    engine-core loop when statistics are on. ``pooling_output``: a pooling model's raw pooled
    vector (float32 values, [hidden]), on the request's only (finished) output.
    ``kv_transfer_params`` (vLLM's, a prefill / decode split): on a producer's finished
    output, where a consumer fetches the prompt's KV; on a consumer's aborted output,
    ``{"error": reason}`` when its load failed.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[LogprobsLists] = None
    new_prompt_logprobs: Optional[LogprobsLists] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[int] = None
    num_cached_tokens: int = 0
    events: Optional[list[EngineCoreEvent]] = None
    pooling_output: Optional[list[float]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """Speculative-decoding counters of one step (vLLM's): requests that verified drafts
    (``num_drafts``), draft tokens verified and accepted, and accepted tokens by draft
    position (``num_accepted_tokens_per_pos[i]``: drafts whose i-th token was accepted)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one request's verified draft of ``num_draft_tokens`` tokens, of which the
        first ``num_accepted_tokens`` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1


class SchedulerStats(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """Counters and gauges of the scheduler after one step (for metrics).

    Token counts are in tokens; ``kv_cache_usage`` is the fraction of blocks in use (0-1).
    ``running_lora_adapters`` / ``waiting_lora_adapters``: names of the LoRA adapters of the
    running / waiting requests (sorted; empty without LoRA).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    spec_decoding_stats: Optional[SpecDecodingStats] = None
    #: The second KV tier (vLLM's external prefix cache): tokens looked up there, and found.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


class EngineCoreOutputs(
    msgspec.Struct, array_like=True, omit_defaults=True  # type: ignore[call-arg]
):
    """All outputs of one EngineCore step, plus the step's scheduler statistics.

    ``engine_index``: the data-parallel replica that ran the step (0 without replicas; set
    by the front end's ``DPAsyncMPClient`` as the outputs arrive).
    """

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: Optional[SchedulerStats] = None
    timestamp: float = 0.0
    engine_index: int = 0
    #: A data-parallel engine in lockstep got a request while idle and started this wave; the
    #: front end tells the other engines to join it (vLLM's field; ``pagedllm.engine.dp_lockstep``).
    start_wave: Optional[int] = None
