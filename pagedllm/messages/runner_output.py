"""What the model runner returns for one step (plain Python lists; no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pagedllm.messages.engine_core import LogprobsLists


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (and logprobs) of one step.

    Attributes:
        req_ids: the scheduled requests, in the runner's batch order.
        req_id_to_index: request id -> index into the per-request lists below.
        sampled_token_ids: per request, the tokens sampled this step, in order: one per
            request today, several when a step samples several positions of a request
            (speculative decoding); empty when the request's prompt is not fully computed.
        logprobs: one row per sampled token (all requests' tokens, in ``req_ids`` order);
            ``logprobs_index`` maps the index of a request that asked for logprobs to the
            row of its first token, its other tokens following it.
        prompt_logprobs_dict: request id -> (index of the first prompt token covered, the
            logprobs of the prompt tokens this step's chunk predicts).
        failed_req_ids: request id -> why the runner could not serve it (a LoRA adapter
            whose files could not be loaded); the scheduler aborts these.
        spec_token_ids: speculative decoding: per request (``req_ids`` order), the draft
            tokens proposed for its next step (empty when none); None without speculation.
        pooler_output: a pooling model: request id -> the pooled vector (float32 values,
            [hidden]) of each request whose prompt is now all computed.
        finished_recving: ids of the requests whose second-tier loads (``LOAD`` transfers)
            are all written into their blocks since the previous step (vLLM's name).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: Optional[LogprobsLists] = None
    logprobs_index: dict[int, int] = field(default_factory=dict)
    prompt_logprobs_dict: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)
    failed_req_ids: dict[str, str] = field(default_factory=dict)
    spec_token_ids: Optional[list[list[int]]] = None
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    finished_recving: set[str] = field(default_factory=set)

    def logprobs_for(self, index: int, num_tokens: int) -> Optional[LogprobsLists]:
        """The logprobs of the first ``num_tokens`` tokens request ``index`` sampled, or
        None if it asked for none."""
        row = self.logprobs_index.get(index)
        if row is None or self.logprobs is None:
            return None
        end = row + num_tokens
        return LogprobsLists(
            token_ids=self.logprobs.token_ids[row:end],
            logprobs=self.logprobs.logprobs[row:end],
            ranks=self.logprobs.ranks[row:end],
        )


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
