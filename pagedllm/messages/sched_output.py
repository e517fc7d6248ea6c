"""What the scheduler decides for one step: plain data, no torch (so it can cross processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Optional

from pagedllm.lora.request import LoRARequest
from pagedllm.messages.kv_transfer import KVConnectorMetadata
from pagedllm.multimodal.inputs import MultiModalFeatureSpec
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


@dataclass
class NewRequestData:
    """A request the model runner has not seen (or is seeing again after a preemption).

    ``token_ids`` holds every known token (prompt, then any outputs generated before a
    preemption); ``block_ids`` is the whole block table so far, one list per KV-cache group
    (block 0, the null block, where a sliding window let a block go); ``lora_request`` is its
    LoRA adapter (None: the base model); ``mm_features`` its images (``MultiModalFeatureSpec``,
    with their tensors; empty: none).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """Changes to requests the runner already holds: blocks appended this step (per
    KV-cache group) and the number of computed tokens before this step (parallel lists).

    ``new_token_ids`` (pipeline parallelism only, else empty; vLLM's field): the known
    tokens each request computes this step, from position ``num_computed_tokens`` on; the
    stages before the last, which sample nothing, learn the sampled tokens from it.
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)


#: ``KVTransfer.kind`` values.
STORE, LOAD, DROP = "store", "load", "drop"


class KVTransfer(NamedTuple):
    """One operation on the second tier, as a worker applies it.

    Attributes:
        kind: ``STORE`` (copy block ``block_id``'s KV, every layer, to the tier under
            ``block_hash``, before this step's forward), ``LOAD`` (copy the tier's
            ``block_hash`` into block ``block_id`` for request ``req_id``) or ``DROP``
            (forget ``block_hash``; ``block_id`` -1).
        block_hash: the block's prefix-cache key.
        block_id: the first tier's block.
        req_id: the loading request (``LOAD`` only; "" otherwise).
    """

    kind: str
    block_hash: bytes
    block_id: int = -1
    req_id: str = ""


@dataclass
class SchedulerOutput:
    """One step's work: ``{request_id: num_scheduled_tokens}`` plus block-table diffs.

    ``finished_req_ids`` are requests the runner must drop (finished, aborted or
    preempted since the previous step). ``scheduled_spec_decode_tokens`` (vLLM's name):
    request id -> the draft tokens it verifies this step (speculative decoding), counted in
    its ``num_scheduled_tokens`` after its one known token; absent for other requests.
    ``num_speculative_tokens`` (adaptive speculation, ``enable_adaptive_k``): request id ->
    how many drafts the runner proposes after this step (0: none), for each request that
    samples in it; empty otherwise (each proposes ``num_speculative_tokens``).
    ``scheduled_encoder_inputs`` (vLLM's): request id -> the indices of its ``mm_features``
    whose encoder runs this step, before the forward; ``free_encoder_mm_hashes``: the content
    hashes of encoder outputs the runner drops (evicted from the encoder cache).
    ``kv_transfers``: the second KV tier's stores, loads and drops (``KVTransfer``s decided by
    ``pagedllm.core.kv_offload``), applied in order, stores before this step's forward.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_speculative_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    kv_transfers: list[KVTransfer] = field(default_factory=list)
    # Structured outputs: rows ``structured_output_request_ids[req_id]`` .. + its number of
    # scheduled draft tokens of ``grammar_bitmask`` ([rows, ceil(vocab_size / 32)] int32
    # numpy) mask that request's sampled tokens this step (the next token, then the one after
    # each draft); only constrained requests that sample this step have rows (None: none).
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Optional["np.ndarray"] = None
    # A prefill / decode split: the KV loads before this step's forward and the saves after
    # it (``pagedllm.distributed.kv_transfer``); None without a KV connector.
    kv_connector_metadata: Optional[KVConnectorMetadata] = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
