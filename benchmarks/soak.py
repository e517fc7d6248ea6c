"""Soak a running OpenAI server: many streamed completions, then check that it is idle again.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python -m pagedllm.entrypoints.cli serve \\
        benchmarks/checkpoints/tiny-llama --port 8000 --dtype float32 --max-model-len 256 \\
        --num-gpu-blocks-override 40 --max-num-seqs 8 --scheduling-policy priority \\
        --max-num-queued-reqs 16 --request-timeout 20 --disable-log-requests &
    PYTHONPATH=$PWD .venv/bin/python benchmarks/soak.py --base-url http://127.0.0.1:8000 \\
        --num-requests 2000 --concurrency 26 --max-tokens 16 32 64

Sends ``--num-requests`` streamed ``/v1/completions`` requests, ``--concurrency`` at a time,
each with a random prompt (token ids), ``max_tokens``, ``priority``; a share of them
disconnect after their first event (``--disconnect-prob``) and another share give up at a
random client deadline (``--deadline-prob``, uniform in ``--deadline-range``). After a 429
the request's slot waits its ``Retry-After`` (``--no-honor-retry-after``: at once). The server's
own deadline (``--request-timeout``) ends a stream with a ``timeout`` error event. It
reports the count of each outcome (``ok``, ``server-timeout``, ``disconnect``,
``client-deadline``, ``429``, ``status-<code>``, ``error``), TTFT p50 / p99 of the streams that
got a token, how much the server's preemption, rejection and timeout counters grew (its
rejections should equal the 429s when no other client sends), then polls ``/metrics``
until ``pagedllm:num_requests_running``, ``_waiting`` and ``kv_cache_usage_perc`` (the
share of KV blocks held) are 0, for at most ``--idle-timeout`` seconds. Exit status 1 when a request got an unexpected answer
(``status-*`` other than 429, or ``error``), the 429s and the server's rejections differ, or
the server is not idle in time;
``--output-json`` writes the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from typing import Any, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

GAUGES = ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc")
#: Counters whose growth over the soak is reported.
COUNTERS = ("pagedllm:num_preemptions_total", "pagedllm:request_rejected_total", "pagedllm:request_timeout_total")
#: Outcomes that a healthy server under overload may give.
EXPECTED = {"ok", "server-timeout", "disconnect", "client-deadline", "429"}


def percentile(values: list[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0-100) of ``values`` by nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def metrics(http: httpx.AsyncClient, names: tuple[str, ...]) -> dict[str, float]:
    """The samples ``names`` of ``/metrics``, each summed over its label sets (engines,
    reasons); 0 for one the server does not export."""
    text = (await http.get("/metrics")).text
    values = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values


async def one(http: httpx.AsyncClient, model: str, rng: random.Random, args: argparse.Namespace
              ) -> tuple[str, Optional[float]]:
    """Send one streamed completion; returns (outcome, TTFT in seconds or None)."""
    body = {"model": model, "prompt": [rng.randrange(3, 1000) for _ in range(rng.randint(*args.prompt_len))],
            "max_tokens": rng.choice(args.max_tokens), "ignore_eos": True, "stream": True,
            "priority": rng.randrange(-1, 3)}
    disconnect = rng.random() < args.disconnect_prob
    deadline = rng.uniform(*args.deadline_range) if rng.random() < args.deadline_prob else None
    start = time.perf_counter()
    ttft: Optional[float] = None
    retry_after = 0.0

    async def read() -> str:
        nonlocal ttft, retry_after
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 429:
                await response.aread()
                retry_after = min(float(response.headers.get("Retry-After", 1)), 10.0)
                return "429"
            if response.status_code != 200:
                await response.aread()
                return f"status-{response.status_code}"
            error = None  # the outcome an error event names
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    return error or "ok"
                event = json.loads(data)
                if "error" in event:
                    error = "server-timeout" if event["error"].get("code") == "timeout" else "error"
                    continue
                if ttft is None and any(c.get("text") for c in event.get("choices", ())):
                    ttft = time.perf_counter() - start
                if disconnect:
                    return "disconnect"
            return "error"  # the stream ended without [DONE]

    try:
        outcome = await (read() if deadline is None else asyncio.wait_for(read(), deadline))
    except asyncio.TimeoutError:
        outcome = "client-deadline"
    except httpx.HTTPError:
        outcome = "error"
    if outcome == "429" and args.honor_retry_after:  # as OpenAI's clients: the slot waits before its next request
        await asyncio.sleep(retry_after)
    return outcome, ttft


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        slots = asyncio.Semaphore(args.concurrency)
        counters_before = await metrics(http, COUNTERS)

        async def bounded() -> tuple[str, Optional[float]]:
            async with slots:
                return await one(http, model, rng, args)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded() for _ in range(args.num_requests)))
        elapsed = time.perf_counter() - start
        idle_start = time.perf_counter()
        while True:
            last = await metrics(http, GAUGES)
            idle = not any(last.values())
            if idle or time.perf_counter() - idle_start > args.idle_timeout:
                break
            await asyncio.sleep(0.05)
        counters_after = await metrics(http, COUNTERS)
    ttfts = [t for _, t in results if t is not None]
    counts = Counter(outcome for outcome, _ in results)
    grown = {name.removeprefix("pagedllm:"): int(counters_after[name] - counters_before[name]) for name in COUNTERS}
    return {
        "num_requests": args.num_requests, "concurrency": args.concurrency, "duration_s": round(elapsed, 2),
        "outcomes": dict(sorted(counts.items())), "unexpected": sum(n for o, n in counts.items() if o not in EXPECTED),
        "ttft_p50_ms": None if not ttfts else round(percentile(ttfts, 50) * 1000, 1),
        "ttft_p99_ms": None if not ttfts else round(percentile(ttfts, 99) * 1000, 1),
        "server_counters": grown,
        # Every 429 the client saw is one the server counted (no other client: equal).
        "rejections_match": grown["request_rejected_total"] == counts.get("429", 0),
        "idle": idle, "idle_after_s": round(time.perf_counter() - idle_start, 2), "gauges_after": last,
    }


def _int_pair(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split(","))
    return low, high


def _float_pair(text: str) -> tuple[float, float]:
    low, high = (float(v) for v in text.split(","))
    return low, high


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server (http://host:port).")
    parser.add_argument("--model", default=None, help="Model name sent (default: the first of /v1/models).")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=26, help="Requests in flight at once.")
    parser.add_argument("--prompt-len", type=_int_pair, default=(4, 60), metavar="MIN,MAX",
                        help="Prompt length in tokens, uniform.")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[16, 32, 64],
                        help="max_tokens values, one drawn per request.")
    parser.add_argument("--disconnect-prob", type=float, default=0.15,
                        help="Share of requests that disconnect after their first event.")
    parser.add_argument("--deadline-prob", type=float, default=0.1,
                        help="Share of requests that give up at a random client deadline.")
    parser.add_argument("--deadline-range", type=_float_pair, default=(0.05, 2.0), metavar="MIN,MAX",
                        help="Client deadline in seconds, uniform.")
    parser.add_argument("--honor-retry-after", action=argparse.BooleanOptionalAction, default=True,
                        help="After a 429, the slot waits the answer's Retry-After before its next request.")
    parser.add_argument("--timeout", type=float, default=120.0, help="HTTP timeout of each request (seconds).")
    parser.add_argument("--idle-timeout", type=float, default=5.0,
                        help="Seconds the server may take to be idle after the last request.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    report = asyncio.run(soak(args))
    print(json.dumps(report, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["idle"] and not report["unexpected"] and report["rejections_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
