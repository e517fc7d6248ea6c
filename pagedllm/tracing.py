"""One OpenTelemetry span per request, exported over OTLP/gRPC (``--otlp-traces-endpoint``).

As vLLM's request tracing: when an engine request finishes, a span named ``llm_request``
(kind SERVER) is sent, starting at the request's arrival and ending when the front end
saw it finish, with the ``gen_ai.*`` attributes below (names from OpenTelemetry's
generative-AI semantic conventions, and vLLM's for those the conventions lack). Each of the
``n`` completions of a request is an engine request with a span of its own; they share
``gen_ai.request.id``, the user request's id. An aborted request gets its span too
(``gen_ai.response.finish_reasons`` = ``["abort"]``; vLLM sends none).

A request that carries W3C trace context (``traceparent`` / ``tracestate``: HTTP headers of the
generating routes, or gRPC metadata, picked by ``trace_headers_of`` and passed to
``AsyncLLM.generate`` as ``trace_headers``) gets its span as a child of the caller's; a
malformed ``traceparent`` is ignored (a new trace), an unsampled one (flags ``00``) means no span.

=============================================  =======  =========================================
attribute                                      type     value
=============================================  =======  =========================================
gen_ai.request.id                              str      the user request's id
gen_ai.response.model                          str      the served model name
gen_ai.request.temperature / top_p             float    the request's sampling parameters
gen_ai.request.max_tokens / n                  int      (``max_tokens``: the effective limit)
gen_ai.usage.prompt_tokens / completion_tokens int      tokens
gen_ai.latency.time_to_first_token             float    s, arrival -> first token received
gen_ai.latency.e2e                             float    s, arrival -> finish received
gen_ai.latency.time_in_queue                   float    s, queued -> first scheduled (engine)
gen_ai.latency.time_in_model_prefill           float    s, first scheduled -> first token (engine)
gen_ai.latency.time_in_model_decode            float    s, first -> last token (engine)
gen_ai.latency.time_in_model_inference         float    s, prefill + decode
gen_ai.response.finish_reasons                 str[]    ``["stop"]``, ``["length"]`` or ``["abort"]``
=============================================  =======  =========================================

Times are those of ``pagedllm.metrics.stats`` (the Prometheus histograms' values). With
``--collect-detailed-traces`` the span also has the events ``queued``, ``scheduled``,
``first_token`` and ``last_token`` at the engine's timestamps.

Spans are batched (the SDK's ``BatchSpanProcessor``; its ``OTEL_BSP_*`` variables apply) and
sent in a background thread: a collector that is down costs log lines, never a request.
The OpenTelemetry packages are imported only when tracing is on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from pagedllm.config.observability import ObservabilityConfig
from pagedllm.metrics.stats import FinishedRequestStats, RequestStateStats
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
#: The W3C trace-context headers a request may carry (``trace_headers``).
TRACE_HEADERS = ("traceparent", "tracestate")

GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_N = "gen_ai.request.n"
GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"


def trace_headers_of(headers: Mapping[str, str]) -> dict[str, str]:
    """The ``TRACE_HEADERS`` among ``headers`` (HTTP headers or gRPC metadata, lower-case keys)."""
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass
class _Pending:
    """What a span needs from a request's start (its own stats come at its end)."""

    parent_id: str
    params: SamplingParams
    max_tokens: int
    context: Any


class RequestTracer:
    """Sends the span of each finished engine request (see the module docstring).

    Args:
        config: the endpoint and whether spans carry the detailed timeline.
        model_name: ``gen_ai.response.model``.
        exporter: the span exporter (default: OTLP/gRPC to ``config.otlp_traces_endpoint``).

    Raises:
        ImportError: the OpenTelemetry SDK or its OTLP/gRPC exporter is not installed.
    """

    def __init__(self, config: ObservabilityConfig, model_name: str, exporter: Any = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            if exporter is None:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

                exporter = OTLPSpanExporter(endpoint=config.otlp_traces_endpoint)
        except ImportError as exc:
            raise ImportError(
                f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/gRPC exporter "
                f"(pip install 'pagedllm[otel]'): {exc}"
            ) from exc
        self.model_name = model_name
        self.detailed = config.detailed
        self._provider = TracerProvider(resource=Resource.create({"service.name": "pagedllm"}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pagedllm")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER
        self._pending: dict[str, _Pending] = {}

    def add_request(
        self,
        request_id: str,
        parent_id: str,
        params: SamplingParams,
        max_tokens: int,
        trace_headers: Optional[Mapping[str, str]] = None,
    ) -> None:
        """Remember an engine request (``parent_id``: the user request's id) until it ends;
        ``max_tokens`` is its effective limit, ``trace_headers`` the caller's trace context."""
        context = self._propagator.extract(dict(trace_headers)) if trace_headers else None
        self._pending[request_id] = _Pending(parent_id, params, max_tokens, context)

    def end_request(self, request_id: str, state: RequestStateStats, finished: FinishedRequestStats, now: float) -> None:
        """Send the span of the engine request ``request_id``, which finished (was received
        finished, or was aborted) at ``now`` (``time.time()`` s). Unknown ids are ignored."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        params = pending.params
        attributes = {
            GEN_AI_REQUEST_ID: pending.parent_id,
            GEN_AI_RESPONSE_MODEL: self.model_name,
            GEN_AI_REQUEST_TEMPERATURE: float(params.temperature),
            GEN_AI_REQUEST_TOP_P: float(params.top_p),
            GEN_AI_REQUEST_MAX_TOKENS: pending.max_tokens,
            GEN_AI_REQUEST_N: params.n,
            GEN_AI_USAGE_PROMPT_TOKENS: finished.num_prompt_tokens,
            GEN_AI_USAGE_COMPLETION_TOKENS: finished.num_generation_tokens,
            GEN_AI_LATENCY_E2E: finished.e2e_latency,
            GEN_AI_LATENCY_TIME_IN_QUEUE: finished.queued_time,
            GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: finished.prefill_time,
            GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: finished.decode_time,
            GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: finished.prefill_time + finished.decode_time,
            GEN_AI_RESPONSE_FINISH_REASONS: [finished.finished_reason],
        }
        if state.first_token_time:
            attributes[GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = state.first_token_time - state.arrival_time
        span = self._tracer.start_span(
            SPAN_NAME, context=pending.context, kind=self._server_kind, attributes=attributes,
            start_time=_ns(state.arrival_time),
        )  # fmt: skip
        if self.detailed:
            timeline = (
                ("queued", state.queued_ts), ("scheduled", state.scheduled_ts),
                ("first_token", state.first_token_ts), ("last_token", state.last_token_ts),
            )  # fmt: skip
            for name, timestamp in timeline:
                if timestamp:
                    span.add_event(name, timestamp=_ns(timestamp))
        span.end(end_time=_ns(now))

    def forget(self, request_id: str) -> None:
        """Drop an engine request that never reached the engine (nothing is sent)."""
        self._pending.pop(request_id, None)

    def shutdown(self) -> None:
        """Send the spans still batched and stop the exporter (waits for the collector, at
        most the SDK's export timeout)."""
        self._provider.shutdown()


def make_request_tracer(config: ObservabilityConfig, model_name: str) -> Optional[RequestTracer]:
    """A ``RequestTracer`` when ``config`` sets an endpoint, else None.

    Raises:
        ImportError: see ``RequestTracer``.
    """
    return RequestTracer(config, model_name) if config.tracing_enabled else None
