"""/metrics counts exactly what the server did (deltas around 10 requests of known sizes)."""

from __future__ import annotations

import time

from tests.entrypoints.openai.conftest import MODEL_NAME

PROMPT_LENGTHS = [3, 5, 8, 13, 21, 4, 6, 9, 11, 2]
MAX_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def _settled_metrics(server) -> dict[str, float]:
    """Metrics once the engine is idle (gauges update after the engine's next step)."""
    deadline = time.monotonic() + 2.0
    while True:
        metrics = server.metrics()
        idle = metrics.get("pagedllm:num_requests_running", 0) == 0 and metrics.get("pagedllm:num_requests_waiting", 0) == 0
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_counters_and_histograms_are_exact(server):
    before = _settled_metrics(server)
    client = server.client()
    for length, max_tokens in zip(PROMPT_LENGTHS, MAX_TOKENS):
        prompt = list(range(10, 10 + length))
        reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens == length and reply.usage.completion_tokens == max_tokens
    after = _settled_metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("pagedllm:prompt_tokens_total") == sum(PROMPT_LENGTHS)
    assert delta("pagedllm:generation_tokens_total") == sum(MAX_TOKENS)
    assert delta("pagedllm:request_success_total{finished_reason=length}") == 10
    for histogram in (
        "pagedllm:time_to_first_token_seconds",
        "pagedllm:e2e_request_latency_seconds",
        "pagedllm:request_queue_time_seconds",
        "pagedllm:request_prefill_time_seconds",
        "pagedllm:request_decode_time_seconds",
        "pagedllm:request_prompt_tokens",
        "pagedllm:request_generation_tokens",
        "pagedllm:request_params_n",
        "pagedllm:request_params_max_tokens",
    ):
        assert delta(f"{histogram}_count") == 10, histogram
    assert delta("pagedllm:request_prompt_tokens_sum") == sum(PROMPT_LENGTHS)
    assert delta("pagedllm:request_generation_tokens_sum") == sum(MAX_TOKENS)
    assert delta("pagedllm:request_params_max_tokens_sum") == sum(MAX_TOKENS)
    # One inter-token latency per generated token after the first.
    assert delta("pagedllm:inter_token_latency_seconds_count") == sum(MAX_TOKENS) - 10
    assert delta("pagedllm:iteration_tokens_total_sum") == sum(PROMPT_LENGTHS) + sum(MAX_TOKENS) - 10
    assert after["pagedllm:kv_cache_usage_perc"] == 0.0
