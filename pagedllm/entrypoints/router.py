"""``pagedllm router``: one OpenAI endpoint in front of prefill and decode instances.

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a prefill
instance (``pagedllm serve --role prefill``), as a copy with ``max_tokens`` 1, not
streamed, and ``kv_transfer_params={"do_remote_decode": true}``; the ``kv_transfer_params``
of its response then go with the original request to a decode instance (``--role
decode``), whose answer (streamed or not) is the client's. Instances are taken round-robin
from ``--prefill`` and ``--decode`` (base URLs, as ``http://host:port``; ``InstancePool``).

Failover: an instance the router cannot connect to (refused, or no connection in the connect
timeout: the request never reached it) is marked unhealthy for ``--unhealthy-backoff-s`` and
the request goes to the next one; an unhealthy instance gets requests again after its
back-off (and at once when no instance of its kind is healthy). When no instance of a kind
can be reached the answer is a 503 in OpenAI's error JSON naming each; an instance that
fails after the request reached it is a 502 (the request is not sent twice). An instance's
error answer is passed on as it is. ``GET /v1/models`` is a decode instance's (the same
failover); ``GET /health`` is the router's.

Light at import (argparse only): FastAPI, httpx and uvicorn are imported when it runs.
"""

# NOTE: no ``from __future__ import annotations``: FastAPI reads the handlers' annotations
# (``Request``, imported inside ``build_app``) at run time.
import argparse
import logging
import time
import urllib.parse
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

#: The routes a request is split on, and the field each caps its length with.
ROUTES = {"/v1/completions": ("max_tokens",), "/v1/chat/completions": ("max_tokens", "max_completion_tokens")}
#: Seconds to wait for an instance's answer (a long prompt may queue).
READ_TIMEOUT_S = 600.0
#: The request headers passed on to both instances: the API key, the request id, and the W3C
#: trace context (the instances' spans join the caller's trace).
FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")
#: Seconds an instance that refused a connection is skipped (``--unhealthy-backoff-s``).
UNHEALTHY_BACKOFF_S = 5.0


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


class InstancePool:
    """The instances of one kind, round-robin, skipping those that could not be reached.

    Args:
        kind: "prefill" or "decode" (for messages).
        urls: the instances' base URLs (``base_url``), at least one.
        backoff_s: seconds an instance stays unhealthy after ``mark_down``.
        clock: monotonic seconds (a test's fake clock).
    """

    def __init__(self, kind: str, urls: Sequence[str], backoff_s: float = UNHEALTHY_BACKOFF_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kind, self.urls, self.backoff_s, self.clock = kind, list(urls), backoff_s, clock
        self._next = 0
        #: url -> when its back-off ends.
        self._down_until: dict[str, float] = {}
        #: url -> why it was marked down (last time).
        self._reasons: dict[str, str] = {}

    def candidates(self) -> list[str]:
        """The instances to try, in order: from the round-robin position, the healthy ones
        (and those whose back-off is over); when there are none, the unhealthy ones, the
        one whose back-off ends first first. The next call starts after the first of these
        (so a skipped instance's share is spread, not given to its successor)."""
        ordered = self.urls[self._next:] + self.urls[: self._next]
        now = self.clock()
        healthy = [u for u in ordered if self._down_until.get(u, 0.0) <= now]
        candidates = healthy or sorted(ordered, key=lambda u: self._down_until[u])
        self._next = (self.urls.index(candidates[0]) + 1) % len(self.urls)
        return candidates

    def mark_down(self, url: str, reason: str) -> None:
        """``url`` could not be reached: skip it for ``backoff_s``."""
        if url not in self._down_until:
            logger.warning("The %s instance at %s cannot be reached (%s): skipped for %g s.", self.kind, url,
                           reason, self.backoff_s)
        self._down_until[url] = self.clock() + self.backoff_s
        self._reasons[url] = reason

    def skipped(self, tried: Sequence[str]) -> list[str]:
        """The instances not in ``tried`` (all in their back-off), each as ``"url (reason; tried
        again in N s)"``."""
        now = self.clock()
        return [f"{u} ({self._reasons[u]}; tried again in {max(self._down_until[u] - now, 0):.0f} s)"
                for u in self.urls if u not in tried and u in self._down_until]

    def mark_up(self, url: str) -> None:
        """``url`` answered."""
        self._reasons.pop(url, None)
        if self._down_until.pop(url, None) is not None:
            logger.info("The %s instance at %s answers again.", self.kind, url)


class _Unanswered(Exception):
    """No instance of a kind answered: ``response`` is the client's (a 503 or a 502)."""

    def __init__(self, response: Any) -> None:
        self.response = response


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


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], client: Any = None,
              unhealthy_backoff_s: float = UNHEALTHY_BACKOFF_S) -> Any:
    """The router's FastAPI app over the instances at ``prefill_urls`` and ``decode_urls``;
    ``client``: the ``httpx.AsyncClient`` it sends with (default: a new one);
    ``unhealthy_backoff_s``: how long an instance that could not be reached is skipped.

    Raises:
        ValueError: no prefill or no decode URL, one that is not ``http(s)://host``, or a
            back-off that is not a positive number.
    """
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    from pagedllm.entrypoints.openai.errors import error_response

    if not prefill_urls or not decode_urls:
        raise ValueError("pagedllm router needs at least one --prefill and one --decode URL.")
    if not unhealthy_backoff_s > 0:
        raise ValueError(f"unhealthy_backoff_s must be a positive number of seconds, got {unhealthy_backoff_s!r}.")
    prefills = InstancePool("prefill", [base_url(u) for u in prefill_urls], unhealthy_backoff_s)
    decodes = InstancePool("decode", [base_url(u) for u in decode_urls], unhealthy_backoff_s)
    http = client or httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S))
    app = FastAPI(title="pagedllm router")

    async def send(pool: InstancePool, make: Callable[[str], Any], stream: bool = False) -> Any:
        """``make(url)``'s request sent to the first instance of ``pool`` that takes the
        connection; its response (with ``stream``, its body not read yet).

        Raises:
            _Unanswered: none took it (a 503 naming each), or the one that did failed before
                its answer (a 502: the request is not sent twice).
        """
        errors, candidates = [], pool.candidates()
        for url in candidates:
            try:
                response = await http.send(make(url), stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                reason = str(exc) or type(exc).__name__
                pool.mark_down(url, reason)
                errors.append(f"{url} ({reason})")
                continue
            except httpx.HTTPError as exc:
                raise _Unanswered(error_response(502, f"The {pool.kind} instance at {url} failed: {exc}",
                                                "BadGatewayError", None, 502)) from None
            pool.mark_up(url)
            return response
        errors += pool.skipped(candidates)
        raise _Unanswered(error_response(503, f"No {pool.kind} instance can be reached: {'; '.join(errors)}.",
                                        "ServiceUnavailableError", None, 503))

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
        prefill_request = prefill_body(body, route)
        stream = bool(body.get("stream"))
        try:
            prefilled = await send(
                prefills, lambda url: http.build_request("POST", url + route, json=prefill_request, headers=headers))
            if prefilled.status_code != 200:
                return passed_on(prefilled)
            params = prefilled.json().get("kv_transfer_params")
            decode_request = {**body, "kv_transfer_params": params} if params else body
            # NOTE: a decode instance that refuses the connection never fetched the KV: the next one can.
            upstream = await send(
                decodes, lambda url: http.build_request("POST", url + route, json=decode_request, headers=headers),
                stream=stream)
        except _Unanswered as exc:
            return exc.response
        if not stream:
            return passed_on(upstream)
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
        headers = forwarded_headers(request)
        try:
            return passed_on(await send(decodes, lambda url: http.build_request("GET", url + "/v1/models",
                                                                                  headers=headers)))
        except _Unanswered as exc:
            return exc.response

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def main(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(args.prefill, args.decode, unhealthy_backoff_s=args.unhealthy_backoff_s)
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


def _positive_seconds(text: str) -> float:
    """argparse ``type`` of ``--unhealthy-backoff-s``."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}.")
    return value


def register(subparsers: Any) -> None:
    """Add ``router`` to the ``pagedllm`` command (``func``: ``main``)."""
    parser = subparsers.add_parser(
        "router", help="Serve one OpenAI endpoint over prefill and decode instances.",
        description="Send each completion or chat request to a prefill instance (pagedllm serve --role prefill), "
        "then to a decode instance (--role decode) with the prefill's kv_transfer_params; round-robin over each "
        "kind, skipping an instance that refuses connections for --unhealthy-backoff-s (docs/deployment.md).",
    )  # fmt: skip
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", type=_url_arg,
                        help="Base URLs of the prefill instances (http://host:port).")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", type=_url_arg,
                        help="Base URLs of the decode instances (http://host:port).")
    parser.add_argument("--unhealthy-backoff-s", type=_positive_seconds, default=UNHEALTHY_BACKOFF_S, metavar="S",
                        help="Seconds an instance that cannot be reached (connection refused or not made in time) "
                        "is skipped before the router tries it again; a request goes to the next instance of its "
                        "kind, and when none can be reached the answer is a 503.")
    parser.add_argument("--host", default="0.0.0.0", help="Host to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.set_defaults(func=main)
