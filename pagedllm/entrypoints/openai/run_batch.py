"""``pagedllm run-batch -i IN.jsonl -o OUT.jsonl [MODEL] [serve flags]``: OpenAI's batch
file format, run offline through the server's own endpoints (vLLM's ``run-batch``).

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of
``BATCH_URLS``; each output line, in input order, is ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``: ``body`` is what the endpoint answered
(its OpenAI error body for a 4xx), ``error`` None for a 2xx, else the error's message. A bad
line (not JSON, another URL, ``stream``) gets an output line with status 400 and its error;
it does not stop the batch. The requests run concurrently (the engine batches them), with
a progress bar; ``-i`` / ``-o`` are local paths (``-`` for stdin / stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any, Optional, Sequence

#: The endpoints a batch line may name (vLLM's, less the ones pagedllm does not serve).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``run-batch`` to the ``pagedllm`` command (sets ``func`` to ``main``)."""
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    parser = subparsers.add_parser(
        "run-batch", help="Run a file of OpenAI batch requests (JSONL) and write their responses.",
        description="Run OpenAI batch requests (one JSON object per line: custom_id, method, url, body) through "
        "the server's endpoints and write one response line each. Takes pagedllm serve's flags.",
    )  # fmt: skip
    parser.add_argument("-i", "--input-file", required=True, metavar="PATH", help="Input JSONL file ('-': stdin).")
    parser.add_argument("-o", "--output-file", required=True, metavar="PATH", help="Output JSONL file ('-': stdout).")
    make_arg_parser(parser)
    parser.set_defaults(func=main)
    return parser


def _output_line(custom_id: Optional[str], status_code: int, body: Any, error: Optional[str]) -> dict[str, Any]:
    return {
        "id": f"pagedllm-{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": f"pagedllm-batch-{uuid.uuid4().hex}", "body": body},
        "error": error,
    }


def parse_line(line: str) -> tuple[Optional[str], Optional[dict[str, Any]], Optional[str]]:
    """(custom_id, the request, None) of one input line, or (custom_id or None, None, why it is refused)."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, None, f"The line is not valid JSON: {exc}."
    if not isinstance(item, dict):
        return None, None, "The line must be a JSON object with custom_id, method, url and body."
    custom_id = item.get("custom_id")
    url, body = item.get("url"), item.get("body")
    if item.get("method", "POST") != "POST":
        return custom_id, None, f"method must be POST, got {item.get('method')!r}."
    if url not in BATCH_URLS:
        return custom_id, None, f"URL {url!r} is not supported in a batch; supported: {', '.join(BATCH_URLS)}."
    if not isinstance(body, dict):
        return custom_id, None, "body must be a JSON object (the endpoint's request)."
    if body.get("stream"):
        return custom_id, None, "stream is not supported in a batch."
    return custom_id, item, None


async def run_batch(app: Any, lines: Sequence[str], progress: bool = True) -> list[dict[str, Any]]:
    """The output line of every non-empty input line, in order, each request sent to
    ``app`` (the server's FastAPI app) in-process."""
    import httpx
    from tqdm import tqdm

    items = [parse_line(line) for line in lines if line.strip()]
    bar = tqdm(total=len(items), desc="Running batch", unit="req", disable=not progress)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:

        async def one(custom_id: Optional[str], item: Optional[dict], refused: Optional[str]) -> dict[str, Any]:
            try:
                if item is None:
                    return _output_line(custom_id, 400, None, refused)
                response = await client.post(item["url"], json=item["body"])
                body = response.json()
                error = None
                if response.status_code >= 300:
                    error = (body.get("error") or {}).get("message") if isinstance(body, dict) else str(body)
                return _output_line(custom_id, response.status_code, body, error)
            finally:
                bar.update(1)

        try:
            return list(await asyncio.gather(*(one(*item) for item in items)))
        finally:
            bar.close()


def _read(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def _write(path: str, outputs: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(o) + "\n" for o in outputs)
    if path == "-":
        sys.stdout.write(text)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main(args: argparse.Namespace) -> int:
    """Run the batch; returns 0 (per-line errors are in the output), 2 for a bad flag or an
    unreadable input file, 1 when the engine cannot start."""
    import logging

    from pagedllm.entrypoints.openai.cli_args import _fail, engine_args_from, resolve_api_key
    from pagedllm.entrypoints.openai.frontend_config import FrontendConfig

    args.model = args.model_tag or args.model
    args.api_key = resolve_api_key(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        engine_args = engine_args_from(args)
        frontend = FrontendConfig.from_cli_args(args, api_key=None)
        lines = _read(args.input_file)
    except (ValueError, OSError) as exc:
        return _fail(str(exc), 2)
    return asyncio.run(_main(engine_args, frontend, lines, args.output_file))


async def _main(engine_args: Any, frontend: Any, lines: list[str], output_file: str) -> int:
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.cli_args import _fail

    try:
        engine = AsyncLLM.from_engine_args(engine_args, log_requests=False,
                                           served_model_name=(frontend.served_model_name or [None])[0])
    except (ValueError, OSError) as exc:
        return _fail(str(exc), 2)
    except Exception as exc:  # the engine process failed to start
        return _fail(f"the engine failed to start: {exc}", 1)
    try:
        outputs = await run_batch(build_app(engine, frontend), lines)
    finally:
        engine.shutdown()
    _write(output_file, outputs)
    return 0
