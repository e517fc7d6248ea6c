"""Request and iteration statistics, computed in the front end from EngineCore outputs
(vLLM V1's ``IterationStats`` / ``FinishedRequestStats``).

Clocks: every timestamp is ``time.time()`` seconds. Front-end times (arrival, when an
output was received) and engine times (the ``EngineCoreEvent``s' QUEUED / SCHEDULED
stamps and ``EngineCoreOutputs.timestamp``, the end of the step) are taken on the same
machine, so they are comparable.

What is counted per *engine request* (each of the ``n`` children of a parallel-sampling
request counts as one, as in vLLM V1): prompt and generation tokens, time to first
token, inter-token latency, and one ``FinishedRequestStats`` when it finishes or is
aborted. What is counted per *user request* (once, when its last child finishes):
the ``n`` and ``max_tokens`` parameters.

Definitions (seconds):

- time to first token: first output with tokens received in the front end - arrival.
- inter-token latency: between consecutive outputs with tokens, as received (one value
  per output; an output normally carries one token).
- e2e latency: finish (received) - arrival.
- queued time: first SCHEDULED - QUEUED (engine); for a request that never ran, the
  time from QUEUED until it finished (was aborted).
- prefill time: step end of the first token - first SCHEDULED (engine).
- decode time: step end of the last token - step end of the first token (engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pagedllm.messages.engine_core import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs


@dataclass
class RequestStateStats:
    """Front-end timing state of one engine request (times in ``time.time()`` seconds)."""

    parent_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_generation_tokens: int = 0
    queued_ts: float = 0.0  # engine: QUEUED event
    scheduled_ts: float = 0.0  # engine: first SCHEDULED event
    first_token_ts: float = 0.0  # engine: end of the step that produced the first token
    last_token_ts: float = 0.0  # engine: end of the step that produced the last token
    last_token_time: float = 0.0  # front end: when the last token was received
    first_token_time: float = 0.0  # front end: when the first token was received


@dataclass
class FinishedRequestStats:
    """One finished engine request. Times in seconds, token counts in tokens.

    ``finished_reason`` is "stop", "length" or "abort".
    """

    finished_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queued_time: float
    prefill_time: float
    decode_time: float


@dataclass
class IterationStats:
    """What one batch of engine outputs (normally one engine step) contributed.

    Attributes:
        num_prompt_tokens: prompt lengths of requests whose first token arrived now.
        num_generation_tokens: tokens generated in this batch.
        num_scheduled_tokens: tokens the engine computed in the step (0 for a stats-only
            message, e.g. after an abort while idle).
        time_to_first_tokens_iter / inter_token_latencies_iter: seconds, one value per
            request (see the module docstring).
        finished_requests: engine requests that finished or were aborted.
        n_params_iter / max_tokens_params_iter: per user request that finished
            (``max_tokens`` None is reported as the room left: max_model_len - prompt).
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_scheduled_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    n_params_iter: list[int] = field(default_factory=list)
    max_tokens_params_iter: list[int] = field(default_factory=list)


@dataclass
class _UserRequest:
    n: int
    max_tokens: int
    num_unfinished: int


class RequestStatsTracker:
    """Keeps ``RequestStateStats`` per engine request and fills ``IterationStats``.

    Call ``add_request`` per engine request (child) when it is sent to the engine,
    ``update_from_outputs`` with every ``EngineCoreOutputs``, and ``finish_request``
    when a request finishes (engine finish reason, a stop string, or an abort).
    Outputs of unknown (aborted) ids are ignored.
    """

    def __init__(self) -> None:
        self.requests: dict[str, RequestStateStats] = {}
        self._users: dict[str, _UserRequest] = {}

    def add_request(
        self,
        request_id: str,
        arrival_time: float,
        num_prompt_tokens: int,
        parent_id: Optional[str] = None,
        n: int = 1,
        max_tokens: int = 0,
    ) -> None:
        """Track an engine request; ``parent_id`` is the user request id (None: itself).

        ``max_tokens`` is the effective limit (tokens); ``n`` the user request's ``n``.
        """
        parent_id = parent_id if parent_id is not None else request_id
        self.requests[request_id] = RequestStateStats(parent_id, arrival_time, num_prompt_tokens)
        user = self._users.get(parent_id)
        if user is None:
            self._users[parent_id] = _UserRequest(n, max_tokens, 1)
        else:
            user.num_unfinished += 1

    def update_from_outputs(self, outputs: EngineCoreOutputs, now: float) -> IterationStats:
        """Account one engine message's outputs, received at ``now``; returns its stats."""
        stats = IterationStats()
        if outputs.scheduler_stats is not None:
            stats.num_scheduled_tokens = outputs.scheduler_stats.num_scheduled_tokens
        engine_ts = outputs.timestamp or now
        for output in outputs.outputs:
            state = self.requests.get(output.request_id)
            if state is not None:
                self._update(state, output, engine_ts, now, stats)
        return stats

    @staticmethod
    def _update(
        state: RequestStateStats,
        output: EngineCoreOutput,
        engine_ts: float,
        now: float,
        stats: IterationStats,
    ) -> None:
        for event in output.events or ():
            if event.type == EngineCoreEventType.QUEUED and not state.queued_ts:
                state.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and not state.scheduled_ts:
                state.scheduled_ts = event.timestamp
        num_new = len(output.new_token_ids)
        if num_new == 0:
            return
        stats.num_generation_tokens += num_new
        if state.num_generation_tokens == 0:
            stats.num_prompt_tokens += state.num_prompt_tokens
            stats.time_to_first_tokens_iter.append(now - state.arrival_time)
            state.first_token_ts = engine_ts
            state.first_token_time = now
        else:
            stats.inter_token_latencies_iter.append(now - state.last_token_time)
        state.num_generation_tokens += num_new
        state.last_token_ts = engine_ts
        state.last_token_time = now

    def finish_request(
        self, request_id: str, finished_reason: str, now: float, stats: IterationStats
    ) -> None:
        """Record a finished (or aborted) engine request in ``stats``; unknown ids are ignored."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        queued_ts = state.queued_ts or state.arrival_time
        if state.scheduled_ts:
            queued_time = state.scheduled_ts - queued_ts
        else:
            queued_time = now - queued_ts
        prefill_time = decode_time = 0.0
        if state.first_token_ts:
            prefill_time = state.first_token_ts - (state.scheduled_ts or queued_ts)
            decode_time = state.last_token_ts - state.first_token_ts
        stats.finished_requests.append(
            FinishedRequestStats(
                finished_reason=finished_reason,
                e2e_latency=now - state.arrival_time,
                num_prompt_tokens=state.num_prompt_tokens,
                num_generation_tokens=state.num_generation_tokens,
                queued_time=max(queued_time, 0.0),
                prefill_time=max(prefill_time, 0.0),
                decode_time=max(decode_time, 0.0),
            )
        )
        user = self._users.get(state.parent_id)
        if user is not None:
            user.num_unfinished -= 1
            if user.num_unfinished <= 0:
                del self._users[state.parent_id]
                stats.n_params_iter.append(user.n)
                stats.max_tokens_params_iter.append(user.max_tokens)
