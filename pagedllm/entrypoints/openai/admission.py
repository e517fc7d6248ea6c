"""Serving under pressure: the queue limits (429) and the request deadline (504) of the
OpenAI server, with their counters in ``/metrics``.

A request is *queued* from when the server sends it to the engine until the engine's first
output for it (waiting, or computing its first prompt chunk;
``OutputProcessor.get_queue_depth``). With ``--max-num-queued-reqs N`` a request whose
engine requests would make more than N queued is refused with 429, OpenAI's error body
(``code`` "rate_limit_exceeded") and a ``Retry-After`` header; ``--max-num-queued-tokens``
does the same for their prompt tokens. Below the limits nothing is refused.

With ``--request-timeout S`` a request still unfinished S seconds after the server received
it is aborted in the engine (its blocks are freed at once): a non-streamed one is answered
504 (``code`` "timeout"), a streamed one gets an error event, then ``data: [DONE]``.

Counters (labels ``model_name``), present when a limit or the timeout is set:
``pagedllm:request_rejected_total`` (label ``reason``: ``max_num_queued_reqs`` |
``max_num_queued_tokens``) and ``pagedllm:request_timeout_total``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncGenerator, Optional, Sequence, TypeVar

from prometheus_client import CollectorRegistry, Counter

from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.messages.engine_core import EngineCoreRequest

T = TypeVar("T")

#: Seconds a refused client is told to wait (``Retry-After``).
RETRY_AFTER_S = 1
REJECT_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


class RequestTimeoutError(OpenAIServingError):
    """A request past its ``--request-timeout`` deadline: 504, ``code`` "timeout"."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"The request did not finish within the server's request timeout ({timeout_s:g} s).",
                         504, "timeout_error", code="timeout")


class AdmissionControl:
    """The server's queue limits and deadline (see the module docstring).

    Args:
        max_num_queued_reqs / max_num_queued_tokens: the limits (None: none).
        request_timeout: seconds from receipt to the end of a request (None: none).
        registry: where the counters go (the engine's ``metrics_registry``; None: nowhere);
            registered only with a limit or a timeout.
        model_name: the ``model_name`` label.
    """

    def __init__(self, max_num_queued_reqs: Optional[int] = None, max_num_queued_tokens: Optional[int] = None,
                 request_timeout: Optional[float] = None, registry: Optional[CollectorRegistry] = None,
                 model_name: str = "") -> None:
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.request_timeout = request_timeout
        self._rejected = self._timed_out = None
        if registry is not None and (max_num_queued_reqs or max_num_queued_tokens or request_timeout):
            self._rejected = Counter("pagedllm:request_rejected", "Requests refused by a queue limit (429).",
                                     ["model_name", "reason"], registry=registry)
            self._timed_out = Counter("pagedllm:request_timeout", "Requests aborted at their deadline.",
                                      ["model_name"], registry=registry)
            for reason in REJECT_REASONS:
                self._rejected.labels(model_name, reason)
            self._timed_out.labels(model_name)
        self.model_name = model_name

    def check(self, engine: Any, requests: Sequence[EngineCoreRequest]) -> None:
        """Refuse ``requests`` (one user request's engine requests) if queuing them passes a limit.

        Raises:
            OpenAIServingError: 429 with a ``Retry-After`` header.
        """
        if self.max_num_queued_reqs is None and self.max_num_queued_tokens is None:
            return
        num_reqs, num_tokens = engine.output_processor.get_queue_depth()
        num_reqs += sum(r.sampling_params.n for r in requests)
        num_tokens += sum(len(r.prompt_token_ids) * r.sampling_params.n for r in requests)
        for reason, value, limit, what in (("max_num_queued_reqs", num_reqs, self.max_num_queued_reqs, "requests"),
                                           ("max_num_queued_tokens", num_tokens, self.max_num_queued_tokens,
                                            "prompt tokens")):
            if limit is not None and value > limit:
                if self._rejected is not None:
                    self._rejected.labels(self.model_name, reason).inc()
                error = OpenAIServingError(
                    f"The server is busy: this request would make {value} {what} queued, over its limit of {limit} "
                    f"(--{reason.replace('_', '-')}). Retry after {RETRY_AFTER_S} s.",
                    429, "requests" if what == "requests" else "tokens", code="rate_limit_exceeded")
                error.headers["Retry-After"] = str(RETRY_AFTER_S)
                error.request_id = requests[0].request_id if requests else None
                raise error

    def with_deadline(self, stream: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        """``stream`` ending with ``RequestTimeoutError`` at the deadline (``stream`` is then
        closed, which aborts its engine requests); ``stream`` itself without a timeout."""
        if self.request_timeout is None:
            return stream
        return self._until(stream, time.monotonic() + self.request_timeout)

    async def _until(self, stream: AsyncGenerator[T, None], deadline: float) -> AsyncGenerator[T, None]:
        try:
            while True:
                try:
                    item = await asyncio.wait_for(stream.__anext__(), max(deadline - time.monotonic(), 0))
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    if self._timed_out is not None:
                        self._timed_out.labels(self.model_name).inc()
                    raise RequestTimeoutError(self.request_timeout) from None  # type: ignore[arg-type]
                yield item
        finally:
            await stream.aclose()
