"""Front-end output path: ``EngineCoreOutput`` -> ``RequestOutput`` (vLLM V1's OutputProcessor),
or a pooling request's ``PoolingRequestOutput``.

Per request it keeps an ``IncrementalDetokenizer`` (text and stop strings) and a
``LogprobsProcessor``; per ``n > 1`` request a ``ParentRequest`` that joins the children.

::

    EngineCore step --[EngineCoreOutput...]--> process_outputs
        per request: detokenize, match stop strings, convert logprobs
        -> RequestOutput (returned, or put in the request's RequestOutputCollector)
        -> reqs_to_abort: requests a stop string finished; the caller must abort them
           in the EngineCore (which does not know stop strings)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.logprobs import LogprobsProcessor, TokenTextCache
from pagedllm.messages.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagedllm.engine.parallel_sampling import ParentRequest, merge_delta_completion
from pagedllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, PromptLogprobs, RequestOutput
from pagedllm.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """One request's outputs, handed from the output loop to the consumer (asyncio).

    ``put`` never blocks: if the consumer has not taken the previous output yet, the new
    one is merged into it (DELTA: text, token ids and logprobs are concatenated;
    otherwise the newer completion replaces the older one). An ``Exception`` put here is
    raised by ``get``. Use from a single event loop (not thread-safe).
    """

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: Union[RequestOutput, PoolingRequestOutput, Exception, None] = None
        self.ready = asyncio.Event()

    def put(self, output: Union[RequestOutput, PoolingRequestOutput, Exception]) -> None:
        if self.output is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            _merge_request_output(self.output, output, self.aggregate)

    async def get(self) -> RequestOutput:
        """Wait for the next (possibly merged) output; raises an exception put here."""
        while self.output is None:
            await self.ready.wait()
        return self._take()  # type: ignore[return-value]

    def get_nowait(self) -> Optional[RequestOutput]:
        """The pending output, or None; raises an exception put here."""
        return self._take() if self.output is not None else None

    def _take(self) -> Optional[RequestOutput]:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


def _merge_request_output(into: RequestOutput, new: RequestOutput, aggregate: bool) -> None:
    """Fold a later output of the same request into an earlier, unconsumed one."""
    by_index = {c.index: i for i, c in enumerate(into.outputs)}
    for completion in new.outputs:
        position = by_index.get(completion.index)
        if position is None:
            into.outputs.append(completion)
        elif aggregate:
            merge_delta_completion(into.outputs[position], completion)
        else:
            into.outputs[position] = completion
    into.outputs.sort(key=lambda c: c.index)
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens or into.num_cached_tokens
    into.metrics = new.metrics


@dataclass
class OutputProcessorOutput:
    """Result of one ``process_outputs`` call.

    Attributes:
        request_outputs: outputs of requests added without a queue.
        reqs_to_abort: ids of requests finished by a stop string that the EngineCore
            still runs; the caller must abort them there.
    """

    request_outputs: list[Union[RequestOutput, PoolingRequestOutput]] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class RequestState:
    """Front-end state of one engine request (a child, for ``n > 1``)."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: Optional[str],
        tokenizer: Any,
        decode: Optional[TokenTextCache],
        parent_req: Optional[ParentRequest],
        request_index: int,
        queue: Optional[RequestOutputCollector],
        log_stats: bool,
    ) -> None:
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.pooling_params = request.pooling_params
        self.output_kind = request.sampling_params.output_kind
        self.parent_req = parent_req
        self.request_index = request_index
        self.queue = queue
        self.detokenizer = IncrementalDetokenizer(tokenizer, request)
        self.logprobs_processor = LogprobsProcessor(decode, request)
        self.num_cached_tokens = 0
        #: The engine's ``kv_transfer_params`` for it (a prefill / decode split), once sent.
        self.kv_transfer_params: Optional[dict] = None
        self.log_stats = log_stats
        self.arrival_time = request.arrival_time
        #: Whether the EngineCore has sent an output for it (else it is queued: waiting, or in its first prefill).
        self.started = False
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self._num_sent_tokens = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.detokenizer.output_token_ids

    def update(self, output: EngineCoreOutput) -> Optional[str]:
        """Take one step's output; return the stop string that matched, if any."""
        if output.num_cached_tokens and not self.num_cached_tokens:
            self.num_cached_tokens = output.num_cached_tokens
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        self.logprobs_processor.update_prompt(output.new_prompt_logprobs)
        num_before = len(self.output_token_ids)
        stop_string = self.detokenizer.update(
            output.new_token_ids,
            stop_terminated=output.finish_reason == FinishReason.STOP,
            finished=output.finished,
        )
        num_accepted = len(self.output_token_ids) - num_before
        self.logprobs_processor.update_sample(output.new_logprobs, num_accepted)
        if self.log_stats and num_accepted:
            self.last_token_time = time.time()
            if self.first_token_time is None:
                self.first_token_time = self.last_token_time
        return stop_string

    def make_completion_output(
        self, finish_reason: Optional[FinishReason], stop_reason: Union[int, str, None]
    ) -> Optional[CompletionOutput]:
        """This step's completion, or None when nothing is due (by ``output_kind``)."""
        finished = finish_reason is not None
        if not finished and (
            self.output_kind == RequestOutputKind.FINAL_ONLY
            or len(self.output_token_ids) == self._num_sent_tokens
        ):
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        logprobs = self.logprobs_processor.logprobs
        if delta:
            start = self._num_sent_tokens
            token_ids = self.output_token_ids[start:]
            logprobs = logprobs[start:] if logprobs is not None else None
        else:
            token_ids = list(self.output_token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        self._num_sent_tokens = len(self.output_token_ids)
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
        )

    def pooling_output(self, pooled: list[float], num_cached_tokens: int = 0) -> PoolingRequestOutput:
        """A pooling request's output: the engine's raw vector after its ``PoolingParams``."""
        assert self.pooling_params is not None, "a pooled vector for a request without PoolingParams"
        return PoolingRequestOutput(self.request_id, PoolingOutput(self.pooling_params.apply(pooled)),
                                    self.prompt_token_ids, prompt=self.prompt, num_cached_tokens=num_cached_tokens)

    def prompt_logprobs_to_send(self) -> Optional[PromptLogprobs]:
        """DELTA: the prompt logprobs not sent yet; else all of them."""
        if self.output_kind == RequestOutputKind.DELTA:
            return self.logprobs_processor.pop_prompt_logprobs()
        return self.logprobs_processor.prompt_logprobs

    def metrics(self) -> Optional[dict]:
        if not self.log_stats:
            return None
        return {
            "arrival_time": self.arrival_time,
            "first_token_time": self.first_token_time,
            "last_token_time": self.last_token_time,
            "num_generation_tokens": len(self.output_token_ids),
        }


class OutputProcessor:
    """Turns EngineCore outputs into ``RequestOutput``s (detokenize, stop, logprobs).

    Args:
        tokenizer: a HF tokenizer, or None (no text; ``decoded_token`` None).
        log_stats: fill ``RequestOutput.metrics`` (arrival, first/last token times in
            ``time.time()`` seconds, number of generated tokens) for single requests.
    """

    def __init__(self, tokenizer: Any, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._decode = TokenTextCache(tokenizer) if tokenizer is not None else None

    def get_num_unfinished_requests(self) -> int:
        """Engine requests (children count one each) still running."""
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_queue_depth(self) -> tuple[int, int]:
        """(engine requests, their prompt tokens) sent to the EngineCore that have had no
        output yet: waiting to be scheduled, or computing their first prompt chunks."""
        queued = [len(s.prompt_token_ids) for s in self.request_states.values() if not s.started]
        return len(queued), sum(queued)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: Optional[str],
        parent_req: Optional[ParentRequest] = None,
        request_index: int = 0,
        queue: Optional[RequestOutputCollector] = None,
    ) -> None:
        """Track a request sent to the EngineCore.

        For ``n > 1`` call once per child, with the child's request (from
        ``parent_req.get_child_info(i)``), ``request_index=i`` and the same queue.

        Raises:
            ValueError: if the id is already tracked, or stop strings are set without
                detokenization.
        """
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id!r} is already running.")
        state = RequestState(
            request, prompt, self.tokenizer, self._decode, parent_req, request_index, queue,
            self.log_stats,
        )
        self.request_states[request.request_id] = state
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Handle one EngineCore step's outputs (outputs of unknown ids are ignored)."""
        result = OutputProcessorOutput()
        parents: dict[str, tuple[ParentRequest, RequestState]] = {}
        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:  # aborted meanwhile
                continue
            state.started = True
            if output.pooling_output is not None:
                del self.request_states[state.request_id]
                _emit(state.pooling_output(output.pooling_output, output.num_cached_tokens), state.queue,
                      result.request_outputs)
                continue
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            stop_string = state.update(output)
            parent = state.parent_req
            if parent is not None and not parent.num_cached_tokens:
                parent.num_cached_tokens = state.num_cached_tokens
            if stop_string is not None:
                if not output.finished:
                    result.reqs_to_abort.append(state.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_string
            if finish_reason is not None:
                del self.request_states[state.request_id]
            completion = state.make_completion_output(finish_reason, stop_reason)
            if completion is not None:
                self._route(state, completion, parents, result.request_outputs)
        for parent, state in parents.values():
            self._emit_parent(parent, state, result.request_outputs)
        return result

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Stop tracking requests; return the engine request ids to abort.

        Accepts engine ids and parent ids (a parent id aborts its unfinished children).
        Requests with a queue get a last output with ``finish_reason == "abort"``.
        """
        to_abort: list[str] = []
        parents: dict[str, tuple[ParentRequest, RequestState]] = {}
        for request_id in request_ids:
            parent = self.parent_requests.get(request_id)
            if request_id in self.request_states:
                child_ids = [request_id]
            elif parent is not None:
                child_ids = sorted(c for c in parent.child_requests if c in self.request_states)
            else:
                continue
            for child_id in child_ids:
                state = self.request_states.pop(child_id)
                to_abort.append(child_id)
                completion = state.make_completion_output(FinishReason.ABORT, None)
                if completion is not None:
                    self._route(state, completion, parents, None)
        for parent, state in parents.values():
            self._emit_parent(parent, state, None)
        return to_abort

    def _route(
        self,
        state: RequestState,
        completion: CompletionOutput,
        parents: dict[str, tuple[ParentRequest, RequestState]],
        request_outputs: Optional[list[RequestOutput]],
    ) -> None:
        """Emit a single request's output now, or hand a child's to its parent."""
        parent = state.parent_req
        if parent is not None:
            parent.add_child_output(state.request_id, completion)
            parents[parent.request_id] = (parent, state)
            return
        request_output = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs_to_send(),
            outputs=[completion],
            finished=completion.finished(),
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics(),
            kv_transfer_params=state.kv_transfer_params,
        )
        _emit(request_output, state.queue, request_outputs)

    def _emit_parent(
        self,
        parent: ParentRequest,
        state: RequestState,
        request_outputs: Optional[list[RequestOutput]],
    ) -> None:
        """Emit the parent's joined output for this step, if one is due."""
        if parent.finished:
            self.parent_requests.pop(parent.request_id, None)
        outputs = parent.get_outputs()
        if outputs is None:
            return
        prompt_logprobs = state.logprobs_processor.prompt_logprobs
        if parent.output_kind == RequestOutputKind.DELTA:
            # NOTE: every child computes the same prompt logprobs; send them once.
            if parent.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                parent.prompt_logprobs_sent = True
        request_output = RequestOutput(
            request_id=parent.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=parent.finished,
            num_cached_tokens=parent.num_cached_tokens,
        )
        _emit(request_output, state.queue, request_outputs)


def _emit(
    request_output: Union[RequestOutput, PoolingRequestOutput],
    queue: Optional[RequestOutputCollector],
    request_outputs: Optional[list],
) -> None:
    if queue is not None:
        queue.put(request_output)
    elif request_outputs is not None:
        request_outputs.append(request_output)
