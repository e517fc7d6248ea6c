"""``pagedllm bench serve``: a load generator for any OpenAI-compatible server (pagedllm's,
vLLM's, llama.cpp's ``llama-server``), as ``vllm bench serve``.

Requests come from the synthetic datasets (``--dataset-name random`` ...; ``random-mm``
adds random images to each prompt as ``image_url`` parts of a chat message, for
``--endpoint /v1/chat/completions``; the metrics are the same), arrive as a
Poisson process at ``--request-rate`` requests/s (``inf``: all at once; ``--burstiness``
other than 1 makes the gaps gamma-distributed, as in vLLM), at most ``--max-concurrency``
in flight, and are streamed (``stream: true`` with ``stream_options.include_usage``) with
httpx. For every request: TTFT (time to the first streamed chunk with text), ITL (gaps
between later chunks), TPOT ((latency - TTFT) / (output tokens - 1)) and E2E latency.
Output tokens are the server's ``usage.completion_tokens`` (else the text re-tokenized).

vLLM's result flags work as there: ``--save-result`` writes the JSON to
``--result-filename`` (alias ``--output-json``), else to vLLM's
``BACKEND-RATEqps[-concurrencyN]-MODEL-YYYYMMDD-HHMMSS.json``, under ``--result-dir``;
``--backend openai-chat`` means ``--endpoint /v1/chat/completions`` (the other backends
name OpenAI-compatible servers and send completions).

The JSON uses vLLM's field names: ``duration``, ``completed``,
``total_input_tokens``, ``total_output_tokens``, ``request_throughput``,
``output_throughput``, ``total_token_throughput``, ``max_output_tokens_per_s``,
``max_concurrent_requests``, and for each of ttft, tpot, itl, e2el: ``mean_<m>_ms``,
``median_<m>_ms``, ``std_<m>_ms``, ``p<q>_<m>_ms`` for each ``--metric-percentiles`` q
(default 90, 99); plus the per-request ``input_lens``, ``output_lens``, ``ttfts``,
``itls``, ``errors``.

``--structured-output json`` sends a ``response_format`` json_schema (a typical 10-field
object, or ``--json-schema-path``) with ``--structured-output-ratio`` of the requests
(vLLM's ``benchmark_serving_structured_output`` names).

Example::

    pagedllm bench serve --base-url http://127.0.0.1:8000 --model DIR --dataset-name random \\
        --random-input-len 128 --random-output-len 128 --ignore-eos \\
        --request-rate inf --max-concurrency 8 --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import numpy as np

from pagedllm.benchmarks import machine_info, percentile_label, summarize, write_json
from pagedllm.benchmarks.grammar_compile import TEN_FIELD_SCHEMA
from pagedllm.benchmarks.datasets import (
    MULTIMODAL_DATASET_NAMES,
    SampleRequest,
    add_dataset_args,
    allowed_token_ids,
    dataset_description,
    get_samples,
    to_text_prompt,
)
from pagedllm.entrypoints.sse_client import DONE, asse_events

METRICS = ("ttft", "tpot", "itl", "e2el")
#: ``--backend`` values (vLLM's names of OpenAI-compatible servers); only openai-chat changes the requests.
BACKENDS = ("openai", "vllm", "openai-chat", "sglang", "lmdeploy", "llama.cpp")
CHAT_ENDPOINT = "/v1/chat/completions"
METRIC_NAMES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backend", default="openai", choices=BACKENDS,
                        help="vLLM's request format names: openai-chat sends chat messages (its endpoint "
                             "defaults to /v1/chat/completions); the others send completions")
    parser.add_argument("--endpoint", default=None,
                        help="/v1/completions (default) or /v1/chat/completions")
    parser.add_argument("--model", default=None,
                        help="model (sent as the request's model, and the tokenizer when it is a local "
                             "folder); default: the server's first /v1/models entry")
    parser.add_argument("--served-model-name", default=None, help="name to send instead of --model")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder or Hub id (default: --model, else the served model's folder "
                             "from /v1/models when it is on this machine, else its name)")
    add_dataset_args(parser, default_input_len=1024, default_output_len=128, multimodal=True)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the inter-arrival times; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, llama-server)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompt-format", default="text", choices=["text", "token-ids"],
                        help="send prompts as text (re-encoding to the requested length, default) "
                             "or as token-id lists (exact; needs server support)")
    parser.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    parser.add_argument("--structured-output", default=None, choices=["json"],
                        help="constrain requests with response_format json_schema: --json-schema-path's schema, "
                        "else a typical 10-field object (vLLM's benchmark_serving_structured_output)")
    parser.add_argument("--json-schema-path", default=None, help="the JSON schema of --structured-output json")
    parser.add_argument("--structured-output-ratio", type=float, default=1.0,
                        help="fraction of the requests constrained by --structured-output (every 1/ratio-th one)")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="90,99")
    parser.add_argument("--num-warmups", type=int, default=1, help="untimed requests first (16 tokens each)")
    parser.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--label", default=None, help="name of the server in the result (default: the URL)")
    parser.add_argument("--output-json", "--result-filename", dest="output_json", default=None,
                        help="the result's JSON file (under --result-dir when that is given)")
    parser.add_argument("--save-result", action="store_true",
                        help="write the result's JSON (vLLM's flag): to --result-filename, else to "
                             "BACKEND-RATEqps[-concurrencyN]-MODEL-YYYYMMDD-HHMMSS.json")
    parser.add_argument("--result-dir", default=None, help="folder of the result's JSON (default: the current one)")


@dataclass
class RequestFuncOutput:
    """What one streamed request gave (times in seconds)."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: Optional[int] = None
    ttft: float = 0.0
    latency: float = 0.0
    start_time: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def resolved_endpoint(args: argparse.Namespace) -> str:
    """``--endpoint``, else the chat one for ``--backend openai-chat``, else /v1/completions.

    Raises:
        ValueError: ``--backend openai-chat`` with an endpoint that is not a chat one.
    """
    if args.endpoint is None:
        return CHAT_ENDPOINT if args.backend == "openai-chat" else "/v1/completions"
    if args.backend == "openai-chat" and "chat/completions" not in args.endpoint:
        raise ValueError(f"--backend openai-chat sends chat messages: use --endpoint {CHAT_ENDPOINT} "
                         f"(not {args.endpoint}).")
    return args.endpoint


def result_path(args: argparse.Namespace, model_name: str) -> Optional[str]:
    """Where the result's JSON goes: ``--result-filename`` / ``--output-json`` (under
    ``--result-dir`` when given); with ``--save-result`` alone, vLLM's name
    ``BACKEND-RATEqps[-concurrencyN]-MODEL-YYYYMMDD-HHMMSS.json``; None: not written."""
    name = args.output_json
    if name is None and args.save_result:
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = model_name.rstrip("/").split("/")[-1]
        name = f"{args.backend}-{rate}qps{concurrency}-{model}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if name is None:
        return None
    return os.path.join(args.result_dir, name) if args.result_dir else name


def _api_url(args: argparse.Namespace) -> str:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return base + args.endpoint


async def request_completion(client: Any, url: str, model: str, request: SampleRequest, args: argparse.Namespace,
                             max_tokens: Optional[int] = None, extra: Optional[dict] = None) -> RequestFuncOutput:
    """Send one streaming request; time its chunks."""
    out = RequestFuncOutput(prompt_len=request.prompt_len)
    chat = "chat/completions" in url
    prompt: Any = request.prompt if args.prompt_format == "text" else request.prompt_token_ids
    if prompt is None:
        prompt = request.prompt_token_ids
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens or request.expected_output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        content = [{"type": "text", "text": prompt}, *request.multi_modal_data] if request.multi_modal_data else prompt
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    headers = {"Content-Type": "application/json"}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    out.start_time = start = time.perf_counter()
    last = start
    texts: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:500]}"
                return out
            async for data in asse_events(response.aiter_lines()):
                if data == DONE:
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    out.error = json.dumps(chunk["error"])[:500]
                    return out
                choices = chunk.get("choices") or []
                if choices:
                    choice = choices[0]
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        if not texts:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
                        texts.append(text)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    out.output_tokens = int(usage["completion_tokens"])
            out.latency = time.perf_counter() - start
            out.generated_text = "".join(texts)
            out.success = bool(texts) or (out.output_tokens or 0) > 0
            if not out.success:
                out.error = "the stream carried no text"
    except Exception as exc:  # report, do not crash the benchmark
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _arrivals(requests: list[SampleRequest], rate: float, burstiness: float,
                    rng: np.random.Generator) -> AsyncIterator[tuple[int, SampleRequest]]:
    """Yield requests with gamma(burstiness, 1/(rate*burstiness)) gaps (Poisson when 1)."""
    for i, request in enumerate(requests):
        yield i, request
        if rate == float("inf") or i == len(requests) - 1:
            continue
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))))


def calculate_metrics(requests: list[SampleRequest], outputs: list[RequestFuncOutput], duration: float,
                      tokenizer: Any, percentile_metrics: list[str], percentiles: list[float],
                      bench_start: float) -> dict[str, Any]:
    """vLLM's serving metrics from per-request results."""
    output_lens: list[int] = []
    ttfts, tpots, itls, e2els = [], [], [], []
    completed = 0
    total_input = 0
    token_times: list[float] = []
    spans: list[tuple[float, float]] = []
    for request, out in zip(requests, outputs):
        if not out.success:
            output_lens.append(0)
            continue
        n = out.output_tokens
        if n is None:
            n = len(tokenizer.encode(out.generated_text, add_special_tokens=False)) if tokenizer else len(out.itl) + 1
        output_lens.append(n)
        completed += 1
        total_input += request.prompt_len
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        itls.extend(out.itl)
        if n > 1:
            tpots.append((out.latency - out.ttft) / (n - 1))
        chunk_times = [out.start_time + out.ttft]
        for gap in out.itl:
            chunk_times.append(chunk_times[-1] + gap)
        # spread the request's tokens evenly over its chunks for the per-second peak
        per_chunk = n / max(len(chunk_times), 1)
        token_times.extend((ct - bench_start, per_chunk) for ct in chunk_times)
        spans.append((out.start_time - bench_start, out.start_time - bench_start + out.latency))
    total_output = sum(output_lens)
    max_tokens_per_s = 0.0
    if token_times:
        buckets: dict[int, float] = {}
        for ct, weight in token_times:
            buckets[int(ct)] = buckets.get(int(ct), 0.0) + weight
        max_tokens_per_s = max(buckets.values())
    max_concurrent = 0
    if spans:
        events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
        live = 0
        for _, delta in events:
            live += delta
            max_concurrent = max(max_concurrent, live)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "request_goodput": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_concurrent,
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for metric in METRICS:
        stats = summarize([1000.0 * v for v in values[metric]], percentiles)
        if metric not in percentile_metrics:
            stats = {k: v for k, v in stats.items() if k in ("mean", "median", "std")}
        for key, value in stats.items():
            result[f"{key}_{metric}_ms"] = value
    result["input_lens"] = [r.prompt_len for r in requests]
    result["output_lens"] = output_lens
    result["ttfts"] = [o.ttft for o in outputs]
    result["itls"] = [o.itl for o in outputs]
    result["generated_texts"] = [o.generated_text for o in outputs]
    result["errors"] = [o.error for o in outputs]
    return result


def print_metrics(result: dict[str, Any], percentiles: list[float]) -> None:
    w = 40

    def row(name: str, value: Any, fmt: str = ".2f") -> None:
        print(f"{name:<{w}} {value:<10{fmt}}" if not isinstance(value, str) else f"{name:<{w}} {value}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", result["completed"], "d")
    row("Failed requests:", result["failed"], "d")
    row("Maximum request concurrency:", str(result.get("max_concurrency")))
    row("Request rate (req/s):", str(result.get("request_rate")))
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "d")
    row("Total generated tokens:", result["total_output_tokens"], "d")
    row("Request throughput (req/s):", result["request_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"], "d")
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for metric in METRICS:
        if f"mean_{metric}_ms" not in result:
            continue
        print("{s:{c}^{n}}".format(s=METRIC_NAMES[metric], n=50, c="-"))
        upper = metric.upper()
        row(f"Mean {upper} (ms):", result[f"mean_{metric}_ms"])
        row(f"Median {upper} (ms):", result[f"median_{metric}_ms"])
        for p in percentiles:
            key = f"p{percentile_label(p)}_{metric}_ms"
            if key in result:
                row(f"P{percentile_label(p)} {upper} (ms):", result[key])
    print("=" * 50)


async def _served_models(client: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The server's ``GET /v1/models`` cards (``id``, and ``root``: where the weights are);
    empty when the server does not answer it."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    try:
        response = await client.get(base + "/v1/models")
        response.raise_for_status()
        return list(response.json()["data"])
    except Exception:  # noqa: BLE001 - any failure: the caller needs --model then
        return []


def _tokenizer_source(args: argparse.Namespace, model_name: str, cards: list[dict[str, Any]]) -> Optional[str]:
    """Where the prompts' tokenizer comes from: ``--tokenizer``; else ``--model`` when it is a
    folder; else the served model's folder when the server runs on this machine (its
    ``/v1/models`` card's ``root``); else ``--model`` or the model name as a Hub id (None:
    the model pagedllm ships, when that is what is served)."""
    from pagedllm.model_paths import DEFAULT_MODEL_NAME

    if args.tokenizer:
        return args.tokenizer
    if args.model and os.path.isdir(args.model):
        return args.model
    card = next((c for c in cards if c.get("id") == model_name), cards[0] if cards else {})
    root = card.get("root") or ""
    if any(os.path.isfile(os.path.join(root, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        return root
    if args.model:
        return args.model
    return None if model_name == DEFAULT_MODEL_NAME else model_name


def _load_tokenizer(source: Optional[str]):
    from pagedllm.config import resolve_model_path
    from pagedllm.tokenizer import get_tokenizer

    try:
        return get_tokenizer(resolve_model_path(source))
    except Exception as exc:
        raise ValueError(
            f"Cannot load a tokenizer from {source!r} (needed to build the prompts); pass --tokenizer "
            f"with the served model's checkpoint folder or Hub id."
        ) from exc


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import httpx
    except ImportError as exc:
        raise SystemExit("pagedllm bench serve needs httpx: pip install 'httpx>=0.27'") from exc

    percentile_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in percentile_metrics if m not in METRICS]
    if bad:
        raise ValueError(f"unknown --percentile-metrics {bad}; choose from {list(METRICS)}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    args.endpoint = resolved_endpoint(args)
    check_multimodal_args(args)
    extra = json.loads(args.extra_body) if args.extra_body else None
    constraint = structured_output_body(args)
    url = _api_url(args)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits,
                                 trust_env=False) as client:
        cards = await _served_models(client, args)
        model_name = args.served_model_name or args.model or (cards[0]["id"] if cards else None)
        if model_name is None:
            raise ValueError(f"Cannot read the model name from {args.base_url or args.host}/v1/models; pass --model.")
        tokenizer_source = _tokenizer_source(args, model_name, cards)
        tokenizer = _load_tokenizer(tokenizer_source)
        requests = get_samples(args, tokenizer)
        if args.prompt_format == "text":
            rng = np.random.default_rng(args.seed + 1)
            vocab = allowed_token_ids(tokenizer)
            requests = [to_text_prompt(tokenizer, r, rng, vocab) for r in requests]
        for i in range(args.num_warmups):
            warm = await request_completion(client, url, model_name, requests[i % len(requests)], args,
                                            max_tokens=min(16, requests[0].expected_output_len), extra=extra)
            if not warm.success:
                raise RuntimeError(f"Warm-up request to {url} failed: {warm.error}")

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = None
        if not args.disable_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="Requests")

        constrained = _constrained_indices(len(requests), args.structured_output_ratio if constraint else 0.0)

        async def limited(index: int, request: SampleRequest) -> RequestFuncOutput:
            body = {**(extra or {}), **constraint} if index in constrained else extra
            if semaphore is None:
                out = await request_completion(client, url, model_name, request, args, extra=body)
            else:
                async with semaphore:
                    out = await request_completion(client, url, model_name, request, args, extra=body)
            if bar is not None:
                bar.update(1)
            return out

        rng = np.random.default_rng(args.seed)
        bench_start = time.perf_counter()
        tasks = []
        async for index, request in _arrivals(requests, args.request_rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(limited(index, request)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - bench_start
        if bar is not None:
            bar.close()
    result: dict[str, Any] = {
        "benchmark": "serve",
        "backend": args.backend,
        "label": args.label or (args.base_url or f"http://{args.host}:{args.port}"),
        "endpoint": args.endpoint,
        "model_id": model_name,
        "tokenizer_id": tokenizer_source or model_name,
        "num_prompts": len(requests),
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "prompt_format": args.prompt_format,
        "structured_output": args.structured_output,
        "structured_output_ratio": args.structured_output_ratio if args.structured_output else 0.0,
        **dataset_description(args),
    }
    result.update(calculate_metrics(requests, list(outputs), duration, tokenizer, percentile_metrics,
                                    percentiles, bench_start))
    result["machine"] = machine_info()
    return result


def check_multimodal_args(args: argparse.Namespace) -> None:
    """A dataset with images (``random-mm``) needs the chat endpoint and text prompts.

    Raises:
        ValueError: another endpoint, or ``--prompt-format token-ids``.
    """
    if args.dataset_name not in MULTIMODAL_DATASET_NAMES:
        return
    if "chat/completions" not in resolved_endpoint(args):
        raise ValueError(f"--dataset-name {args.dataset_name} sends images in chat messages: "
                         "use --endpoint /v1/chat/completions.")
    if args.prompt_format != "text":
        raise ValueError(f"--dataset-name {args.dataset_name} sends its prompts as chat text: "
                         "drop --prompt-format token-ids.")


def structured_output_body(args: argparse.Namespace) -> dict[str, Any]:
    """The body fields of ``--structured-output`` (empty without it): OpenAI's
    ``response_format`` of type json_schema, which pagedllm and vLLM take on both endpoints."""
    if args.structured_output is None:
        return {}
    schema = TEN_FIELD_SCHEMA
    if args.json_schema_path:
        with open(args.json_schema_path) as f:
            schema = json.load(f)
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}


def _constrained_indices(num_requests: int, ratio: float) -> set[int]:
    """The requests a ``ratio`` in [0, 1] of constrained ones picks, spread evenly."""
    count = round(num_requests * min(max(ratio, 0.0), 1.0))
    return {int(i * num_requests / count) for i in range(count)} if count else set()


def run(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(benchmark(args))


def main(args: argparse.Namespace) -> int:
    result = run(args)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    print_metrics(result, percentiles)
    errors = [e for e in result["errors"] if e]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}")
    write_json(result_path(args, result["model_id"]), result)
    return 0 if result["completed"] > 0 else 1
