"""``--otlp-traces-endpoint``: one ``llm_request`` span per request, with vLLM's ``gen_ai.*``
attributes, sent over OTLP/gRPC to an in-process collector (opentelemetry-proto's
TraceService), from a real ``pagedllm serve`` (one for the module)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pagedllm.config import EngineArgs
from pagedllm.config.observability import ObservabilityConfig
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.grpc.stubs import load_stubs
from tests.server_utils import RemoteServer, _free_port

MODEL_NAME = "tiny-traced"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it receives: ``spans`` (protobuf ``Span`` objects) and their resources."""

    def __init__(self) -> None:
        self.spans: list = []
        self.service_names: set[str] = set()
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                for attribute in resource_spans.resource.attributes:
                    if attribute.key == "service.name":
                        self.service_names.add(attribute.value.string_value)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, request_id: str, count: int = 1, timeout_s: float = 10.0) -> list:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                found = [span for span in self.spans if attributes(span).get("gen_ai.request.id") == request_id]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


def attributes(span) -> dict:
    """A protobuf span's attributes as a dict (a list value as a list)."""
    values = {}
    for attribute in span.attributes:
        value = attribute.value
        kind = value.WhichOneof("value")
        values[attribute.key] = [v.string_value for v in value.array_value.values] if kind == "array_value" else getattr(value, kind)
    return values


@pytest.fixture(scope="module")
def collector():
    sink = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    sink.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield sink
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def server(tiny_llama, collector):
    import os

    grpc_port = _free_port()
    remote = RemoteServer(
        tiny_llama, "--served-model-name", MODEL_NAME, "--otlp-traces-endpoint", f"http://127.0.0.1:{collector.port}",
        "--collect-detailed-traces", "model,worker", "--grpc", "--grpc-port", str(grpc_port),
        env=dict(os.environ, OTEL_BSP_SCHEDULE_DELAY="50"),  # the SDK's batch delay: 50 ms, not 5 s
    )  # fmt: skip
    remote.grpc_port = grpc_port
    try:
        yield remote
    finally:
        remote.close()


def test_a_span_per_request_with_vllm_attributes(server, collector):
    reply = server.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 5, "temperature": 0.0, "top_p": 0.5,
        "ignore_eos": True,
    }).json()  # fmt: skip
    (span,) = collector.wait_for(reply["id"] + "-0")
    values = attributes(span)
    assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
    assert collector.service_names == {"pagedllm"}
    assert values["gen_ai.response.model"] == MODEL_NAME
    assert values["gen_ai.usage.prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert values["gen_ai.usage.completion_tokens"] == 5
    assert (values["gen_ai.request.temperature"], values["gen_ai.request.top_p"]) == (0.0, 0.5)
    assert (values["gen_ai.request.max_tokens"], values["gen_ai.request.n"]) == (5, 1)
    assert values["gen_ai.response.finish_reasons"] == ["length"]
    e2e, ttft, queue = (values[f"gen_ai.latency.{name}"] for name in ("e2e", "time_to_first_token", "time_in_queue"))
    assert 0.0 < ttft <= e2e and 0.0 <= queue < e2e
    prefill, decode = values["gen_ai.latency.time_in_model_prefill"], values["gen_ai.latency.time_in_model_decode"]
    assert values["gen_ai.latency.time_in_model_inference"] == pytest.approx(prefill + decode)
    assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(e2e, abs=1e-3)
    # --collect-detailed-traces: the engine timeline, in order
    events = [(event.name, event.time_unix_nano) for event in span.events]
    assert [name for name, _ in events] == ["queued", "scheduled", "first_token", "last_token"]
    assert [t for _, t in events] == sorted(t for _, t in events)
    assert span.start_time_unix_nano <= events[0][1] and events[-1][1] <= span.end_time_unix_nano


def test_n_completions_and_a_grpc_parent(server, collector):
    reply = server.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "n": 2, "seed": 1, "ignore_eos": True,
    }).json()  # fmt: skip
    spans = collector.wait_for(reply["id"] + "-0", count=2)
    assert len(spans) == 2 and all(attributes(s)["gen_ai.request.n"] == 2 for s in spans)
    messages, services = load_stubs()
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = services.GenerationStub(channel)
        metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"),)
        request = messages.GenerateRequest(
            request_id="traced-1", text="Hi", sampling_params=messages.SamplingParams(max_tokens=2)
        )
        assert list(stub.Generate(request, metadata=metadata, timeout=60))[-1].finished
    (span,) = collector.wait_for("traced-1")
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID


def _traceparent(span_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{TRACE_ID}-{span_id}-01"}


def test_http_trace_context_is_the_span_parent(server, collector):
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    traced = {  # route -> (body, the parent span id its traceparent names)
        "/v1/completions": ({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}, "00f067aa0ba902b7"),
        "/v1/chat/completions": (chat, "00f067aa0ba902b8"),
        "/v1/responses": ({"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 1}, "00f067aa0ba902b9"),
        "/v1/messages": (chat, "00f067aa0ba902ba"),
    }
    ids = {}
    for path, (body, span_id) in traced.items():
        headers = {**_traceparent(span_id), "tracestate": "congo=t61rcWkgMzE"}
        reply = server.post(path, json=body, headers=headers)
        assert reply.status_code == 200, (path, reply.text)
        ids[path] = reply.json()["id"]
    completion = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
    untraced = [server.post("/v1/completions", json=completion) for _ in range(2)]
    malformed = [
        server.post("/v1/completions", json=completion, headers={"traceparent": value})
        for value in ("00-not-a-trace-01", f"00-{'0' * 32}-{PARENT_SPAN_ID}-01")  # junk; the invalid all-zero id
    ]
    for path, (_, span_id) in traced.items():
        (span,) = collector.wait_for(ids[path] + "-0")
        assert (span.trace_id.hex(), span.parent_span_id.hex()) == (TRACE_ID, span_id), path
        assert span.trace_state == "congo=t61rcWkgMzE", path
    roots = []
    for reply in untraced + malformed:
        assert reply.status_code == 200, reply.text
        (span,) = collector.wait_for(reply.json()["id"] + "-0")
        roots.append(span)
    assert all(not span.parent_span_id and not span.trace_state for span in roots)
    trace_ids = {span.trace_id.hex() for span in roots}
    assert len(trace_ids) == len(roots) and TRACE_ID not in trace_ids and "0" * 32 not in trace_ids


def test_tracing_flags_are_checked():
    args = build_parser().parse_args(["serve", "--collect-detailed-traces", "model,worker"])
    assert args.collect_detailed_traces == ["model", "worker"] and args.otlp_traces_endpoint is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--collect-detailed-traces", "gpu"])
    with pytest.raises(ValueError, match="collect_detailed_traces requires `--otlp-traces-endpoint` to be set"):
        ObservabilityConfig(None, ("model",))
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be"):
        EngineArgs(otlp_traces_endpoint="ftp://collector:4317", usage_context="api_server")
    with pytest.raises(ValueError, match="not supported yet offline"):
        EngineArgs(otlp_traces_endpoint="http://127.0.0.1:4317")
    config = ObservabilityConfig("grpc://collector:4317", ("all",))
    assert config.tracing_enabled and config.detailed


def test_an_aborted_request_gets_its_span_and_unknown_ids_none():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagedllm.metrics.stats import IterationStats, RequestStatsTracker
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    tracer = RequestTracer(ObservabilityConfig("http://unused:4317"), "m", exporter=exporter)
    tracker, stats = RequestStatsTracker(), IterationStats()
    tracker.add_request("0_r", 100.0, 7, "r", n=2, max_tokens=9)
    tracer.add_request("0_r", "r", SamplingParams(n=2, temperature=0.5, max_tokens=9), 9)
    state = tracker.requests["0_r"]
    tracker.finish_request("0_r", "abort", 102.5, stats)
    tracer.end_request("0_r", state, stats.finished_requests[-1], 102.5)
    tracer.end_request("0_r", state, stats.finished_requests[-1], 103.0)  # already sent: ignored
    tracer.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request" and span.attributes["gen_ai.request.id"] == "r"
    assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == ("abort",)
    assert span.attributes["gen_ai.usage.completion_tokens"] == 0 and span.attributes["gen_ai.latency.e2e"] == 2.5
    assert "gen_ai.latency.time_to_first_token" not in span.attributes  # no token came
    assert (span.start_time, span.end_time) == (100 * 10**9, int(102.5 * 1e9)) and not span.events


def test_an_unsampled_parent_means_no_span():
    """Parent-based sampling (the SDK's default): a caller that did not sample its trace
    (``traceparent`` flags ``00``) gets no span; a sampled one does."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagedllm.metrics.stats import IterationStats, RequestStatsTracker
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    tracer = RequestTracer(ObservabilityConfig("http://unused:4317"), "m", exporter=exporter)
    tracker, stats = RequestStatsTracker(), IterationStats()
    for request_id, flags in (("unsampled", "00"), ("sampled", "01")):
        tracker.add_request(request_id, 100.0, 3, request_id, n=1, max_tokens=4)
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-{flags}"}
        tracer.add_request(request_id, request_id, SamplingParams(max_tokens=4), 4, headers)
        state = tracker.requests[request_id]
        tracker.finish_request(request_id, "length", 101.0, stats)
        tracer.end_request(request_id, state, stats.finished_requests[-1], 101.0)
    tracer.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.attributes["gen_ai.request.id"] == "sampled"
    assert (format(span.context.trace_id, "032x"), format(span.parent.span_id, "016x")) == (TRACE_ID, PARENT_SPAN_ID)
