"""``pagedllm router``: one OpenAI endpoint in front of prefill and decode instances.

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a prefill
instance (``pagedllm serve --role prefill``), as a copy with ``max_tokens`` 1, not
streamed, and ``kv_transfer_params={"do_remote_decode": true}``; the ``kv_transfer_params``
of its response then go with the original request to a decode instance (``--role
decode``), whose answer (streamed or not) is the client's. Instances are taken round-robin
from ``--prefill`` and ``--decode`` (base URLs, as ``http://host:port``). An instance's
error answer is passed on as it is; one that cannot be reached is a 502 in OpenAI's error
JSON. ``GET /v1/models`` is the first decode instance's; ``GET /health`` is the router's.

Light at import (argparse only): FastAPI, httpx and uvicorn are imported when it runs.
"""

# NOTE: no ``from __future__ import annotations``: FastAPI reads the handlers' annotations
# (``Request``, imported inside ``build_app``) at run time.
import argparse
import itertools
import logging
import urllib.parse
from typing import Any, Sequence

logger = logging.getLogger(__name__)

#: The routes a request is split on, and the field each caps its length with.
ROUTES = {"/v1/completions": ("max_tokens",), "/v1/chat/completions": ("max_tokens", "max_completion_tokens")}
#: Seconds to wait for an instance's answer (a long prompt may queue).
READ_TIMEOUT_S = 600.0
#: The request headers passed on to both instances: the API key, the request id, and the W3C
#: trace context (the instances' spans join the caller's trace).
FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")


def base_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1`` (the router adds each route's path).

    Raises:
        ValueError: ``url`` is not an ``http://`` or ``https://`` URL with a host.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"an instance's URL must be http://host:port or https://host:port, got {url!r}.")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def prefill_body(body: dict[str, Any], route: str) -> dict[str, Any]:
    """The prefill instance's copy of a request: one token (no ``min_tokens``), not streamed,
    keeping its KV."""
    body = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    for field in ROUTES[route]:
        if field == "max_tokens" or field in body:
            body[field] = 1
    return body


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], client: Any = None) -> Any:
    """The router's FastAPI app over the instances at ``prefill_urls`` and ``decode_urls``;
    ``client``: the ``httpx.AsyncClient`` it sends with (default: a new one).

    Raises:
        ValueError: no prefill or no decode URL, or one that is not ``http(s)://host``.
    """
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from pagedllm.entrypoints.openai.errors import error_response

    if not prefill_urls or not decode_urls:
        raise ValueError("pagedllm router needs at least one --prefill and one --decode URL.")
    prefills = itertools.cycle([base_url(u) for u in prefill_urls])
    decodes = itertools.cycle([base_url(u) for u in decode_urls])
    first_decode = base_url(decode_urls[0])
    http = client or httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S))
    app = FastAPI(title="pagedllm router")

    def unreachable(kind: str, url: str, exc: Exception) -> JSONResponse:
        return error_response(502, f"The {kind} instance at {url} cannot be reached: {exc}", "BadGatewayError", None,
                              502)

    def passed_on(response: Any) -> Response:
        return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))

    def forwarded_headers(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}

    async def split(route: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "The request body is not valid JSON.", "BadRequestError", None, 400)
        if not isinstance(body, dict):
            return error_response(400, "The request body must be a JSON object.", "BadRequestError", None, 400)
        headers = forwarded_headers(request)
        prefill_url, decode_url = next(prefills), next(decodes)
        try:
            prefilled = await http.post(prefill_url + route, json=prefill_body(body, route), headers=headers)
        except httpx.HTTPError as exc:
            return unreachable("prefill", prefill_url, exc)
        if prefilled.status_code != 200:
            return passed_on(prefilled)
        params = prefilled.json().get("kv_transfer_params")
        decode_request = {**body, "kv_transfer_params": params} if params else body
        try:
            if not body.get("stream"):
                return passed_on(await http.post(decode_url + route, json=decode_request, headers=headers))
            upstream = await http.send(http.build_request("POST", decode_url + route, json=decode_request,
                                                          headers=headers), stream=True)
        except httpx.HTTPError as exc:
            return unreachable("decode", decode_url, exc)
        if upstream.status_code != 200:
            await upstream.aread()
            await upstream.aclose()
            return passed_on(upstream)

        async def events():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(events(), upstream.status_code, media_type=upstream.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await split("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await split("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            return passed_on(await http.get(first_decode + "/v1/models", headers=forwarded_headers(request)))
        except httpx.HTTPError as exc:
            return unreachable("decode", first_decode, exc)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def main(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(args.prefill, args.decode)
    logger.info("Routing to prefill %s, decode %s", ", ".join(args.prefill), ", ".join(args.decode))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _url_arg(url: str) -> str:
    """argparse ``type`` of ``--prefill`` / ``--decode``: ``base_url``'s check as a usage error."""
    try:
        base_url(url)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return url


def register(subparsers: Any) -> None:
    """Add ``router`` to the ``pagedllm`` command (``func``: ``main``)."""
    parser = subparsers.add_parser(
        "router", help="Serve one OpenAI endpoint over prefill and decode instances.",
        description="Send each completion or chat request to a prefill instance (pagedllm serve --role prefill), "
        "then to a decode instance (--role decode) with the prefill's kv_transfer_params; round-robin over each "
        "kind (docs/deployment.md).",
    )  # fmt: skip
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", type=_url_arg,
                        help="Base URLs of the prefill instances (http://host:port).")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", type=_url_arg,
                        help="Base URLs of the decode instances (http://host:port).")
    parser.add_argument("--host", default="0.0.0.0", help="Host to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.set_defaults(func=main)
