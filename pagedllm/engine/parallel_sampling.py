"""Parallel sampling (``n > 1``): one user request fanned out into ``n`` child requests.

The EngineCore knows only the children (each with ``n == 1``); the front end gathers their
completions back into one ``RequestOutput`` under the parent's id (vLLM V1 design).
"""

from __future__ import annotations

from typing import Optional

import msgspec

from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """Fan-out/fan-in state of one ``n > 1`` request.

    Args:
        request_id: the user's request id.
        sampling_params: the user's params (``n`` completions).

    Child ``i`` has id ``f"{i}_{request_id}"`` and a copy of the params with ``n = 1``
    and, when a seed is set, ``seed + i`` (completions differ yet are reproducible).

    Outputs, by ``output_kind``:
        FINAL_ONLY: all ``n`` completions, once, when every child has finished.
        CUMULATIVE: every child's latest completion, each time any child progresses.
        DELTA: only the completions of children that progressed since the last output.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.output_kind = sampling_params.output_kind
        #: Ids of children handed out and not finished yet.
        self.child_requests: set[str] = set()
        self._num_finished = 0
        self._latest: dict[int, CompletionOutput] = {}
        self._new: dict[int, CompletionOutput] = {}
        self._sent_final = False
        #: Set by the OutputProcessor: prompt logprobs already sent (DELTA), and the
        #: first prefix-cache hit count a child reported.
        self.prompt_logprobs_sent = False
        self.num_cached_tokens = 0

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """The id and params of child ``index`` (0 <= index < n)."""
        if not 0 <= index < self.n:
            raise ValueError(f"child index must be in [0, {self.n}), got {index}.")
        child_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_id)
        params = self.sampling_params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed += index
        return child_id, params

    @property
    def finished(self) -> bool:
        """True once all ``n`` children have finished."""
        return self._num_finished >= self.n

    def add_child_output(self, child_id: str, completion: CompletionOutput) -> None:
        """Record one step's completion of a child (``completion.index`` = child index)."""
        if completion.finished() and child_id in self.child_requests:
            self.child_requests.discard(child_id)
            self._num_finished += 1
        if self.output_kind == RequestOutputKind.DELTA and completion.index in self._new:
            merge_delta_completion(self._new[completion.index], completion)
        else:
            self._new[completion.index] = completion
        self._latest[completion.index] = completion

    def get_outputs(self) -> Optional[list[CompletionOutput]]:
        """The completions to emit now (ordered by index), or None if nothing is due.

        Call after the ``add_child_output`` calls of a step; it consumes them.
        """
        new, self._new = self._new, {}
        if self._sent_final or not new:
            return None
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            outputs = self._latest
        elif self.output_kind == RequestOutputKind.CUMULATIVE:
            outputs = self._latest
        else:
            outputs = new
        self._sent_final = self.finished
        return [outputs[i] for i in sorted(outputs)]


def fan_out(request: EngineCoreRequest) -> list[tuple[EngineCoreRequest, Optional[ParentRequest], int]]:
    """The engine requests of one validated request, as ``(request, parent, index)``.

    ``n == 1``: the request itself, without a parent. ``n > 1``: ``n`` children (see
    ``ParentRequest``) sharing one ``ParentRequest``; they share the prompt token ids
    (no copy). ``LLMEngine`` and ``AsyncLLM`` both send requests through here.
    """
    params = request.sampling_params
    if params.n == 1:
        return [(request, None, 0)]
    parent = ParentRequest(request.request_id, params)
    children: list[tuple[EngineCoreRequest, Optional[ParentRequest], int]] = []
    for index in range(params.n):
        child_id, child_params = parent.get_child_info(index)
        child = msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
        children.append((child, parent, index))
    return children


def merge_delta_completion(into: CompletionOutput, delta: CompletionOutput) -> None:
    """Merge a later DELTA completion of the same index into an earlier one."""
    into.text += delta.text
    into.token_ids = into.token_ids + delta.token_ids
    if delta.logprobs is not None:
        into.logprobs = (into.logprobs or []) + delta.logprobs
    into.cumulative_logprob = delta.cumulative_logprob
    into.finish_reason = delta.finish_reason
    into.stop_reason = delta.stop_reason
