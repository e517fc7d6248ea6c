"""The server's queue limits and deadline without a server (``AdmissionControl``): the
limits count the engine requests queued (``OutputProcessor.get_queue_depth``) and their
prompt tokens, n included; the deadline closes the stream (which aborts its requests)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pagedllm.entrypoints.openai.admission import AdmissionControl, RequestTimeoutError
from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams


def _engine(num_reqs, num_tokens):
    return SimpleNamespace(output_processor=SimpleNamespace(get_queue_depth=lambda: (num_reqs, num_tokens)))


def _request(num_tokens, n=1):
    return EngineCoreRequest("cmpl-1-0", list(range(num_tokens)), SamplingParams(n=n), None, 0.0)


def test_queue_limits_refuse_with_429_over_the_limit_only():
    registry = CollectorRegistry()
    control = AdmissionControl(max_num_queued_reqs=3, max_num_queued_tokens=100, registry=registry, model_name="m")
    control.check(_engine(2, 10), [_request(5)])  # 3 requests, 15 tokens: at the limits, accepted
    control.check(_engine(0, 0), [_request(100)])
    with pytest.raises(OpenAIServingError) as refused:
        control.check(_engine(2, 10), [_request(5, n=2)])  # n=2: two engine requests
    error = refused.value
    assert error.status_code == 429 and error.code == "rate_limit_exceeded" and error.err_type == "requests"
    assert error.headers == {"Retry-After": "1"} and "4 requests queued, over its limit of 3" in error.message
    response = error.to_response()
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    with pytest.raises(OpenAIServingError, match="101 prompt tokens queued"):
        control.check(_engine(0, 1), [_request(100)])
    assert registry.get_sample_value("pagedllm:request_rejected_total",
                                     {"model_name": "m", "reason": "max_num_queued_reqs"}) == 1
    assert registry.get_sample_value("pagedllm:request_rejected_total",
                                     {"model_name": "m", "reason": "max_num_queued_tokens"}) == 1
    AdmissionControl().check(None, [_request(10**6)])  # no limits: never looks


def test_deadline_ends_the_stream_and_closes_it():
    registry = CollectorRegistry()
    control = AdmissionControl(request_timeout=0.2, registry=registry, model_name="m")
    closed = []

    async def slow():
        try:
            yield 1
            await asyncio.sleep(30)
            yield 2
        finally:
            closed.append(True)

    async def consume(stream):
        items = []
        async for item in stream:
            items.append(item)
        return items

    items = []
    with pytest.raises(RequestTimeoutError) as timed_out:
        asyncio.run(consume(control.with_deadline(_collecting(slow(), items))))
    assert items == [1] and closed == [True]
    assert timed_out.value.status_code == 504 and timed_out.value.code == "timeout"
    assert registry.get_sample_value("pagedllm:request_timeout_total", {"model_name": "m"}) == 1
    assert asyncio.run(consume(control.with_deadline(_fast()))) == [1, 2]
    assert AdmissionControl().with_deadline(stream := _fast()) is stream


async def _collecting(stream, items):
    async for item in stream:
        items.append(item)
        yield item


async def _fast():
    yield 1
    yield 2
