"""The FastAPI application of ``pagedllm serve``: OpenAI routes over an ``EngineClient`` (``AsyncLLM``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``, ``GET /health``,
``GET /version``, ``GET /metrics``, ``GET /server_info`` (the flags and adapters to start it
again: ``server_info``); with ``--enable-sleep-mode`` ``POST /sleep``,
``POST /wake_up``, ``GET /is_sleeping`` (``_add_sleep_routes``); OpenAI's Responses API (``POST /v1/responses``,
``GET`` / ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``); on a pooling
model only (as vLLM, a generative model answers them 404) ``POST /v1/embeddings``,
``/classify``, ``/v1/score`` (``/score``) and ``/v1/rerank`` (``/rerank``, ``/v2/rerank``);
Anthropic's ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (``pagedllm.entrypoints.anthropic``); the chat page at
``GET /`` unless ``--disable-frontend`` (``chat_page``).

- Auth: with an API key, every route except ``/health`` and ``/metrics`` needs
  ``Authorization: Bearer <key>`` or (Anthropic's header) ``x-api-key: <key>``, compared
  in constant time; else 401 (Anthropic's error JSON on ``/v1/messages``).
- Cancellation: a client that disconnects — while waiting for a JSON response or in the
  middle of a stream — cancels its handler; the engine generators are closed, which
  aborts every request (all ``n`` choices) in the engine.
- Tracing: a generating request's W3C trace context headers (``traceparent``, ``tracestate``)
  become the parent of its engine requests' spans (``pagedllm.tracing``; without
  ``--otlp-traces-endpoint`` the engine ignores them; a malformed one starts a new trace).
- ``/health`` is 200 while the engine lives and 503 once it died; it never waits on the
  engine's work, only on the API process's event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from contextlib import asynccontextmanager
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm import envs
from pagedllm.engine.protocol import SLEEP_TAGS, EngineClient
from pagedllm.entrypoints.chat_content_format import log_content_format, template_text
from pagedllm.entrypoints.chat_utils import image_placeholder, video_placeholder
from pagedllm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagedllm.entrypoints.anthropic.serving_messages import error_response as anthropic_error_response
from pagedllm.entrypoints.openai.chat_page import add_chat_page_routes, is_page_path
from pagedllm.entrypoints.openai.admission import AdmissionControl
from pagedllm.entrypoints.openai.frontend_config import FrontendConfig
from pagedllm.entrypoints.openai.errors import (
    INVALID_REQUEST,
    bad_request,
    error_response,
    logged_response,
    register_exception_handlers,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.renderer import PromptRenderer
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_classification import OpenAIServingClassification
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScores
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.server_info import server_info
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.metrics.loggers import log_stats_interval
from pagedllm.tracing import trace_headers_of
from pagedllm.version import __version__

logger = logging.getLogger(__name__)

#: The routes of Anthropic's Messages API (their errors, a 401 too, are Anthropic's JSON).
ANTHROPIC_PATH = "/v1/messages"
#: Routes open without an API key (load balancers and Prometheus scrape them).
PUBLIC_PATHS = frozenset({"/health", "/metrics"})
#: Seconds ``/health`` waits for ``EngineClient.check_health`` before answering 503.
HEALTH_TIMEOUT_S = 5.0
#: Status sent (to nobody) when the client went away before the response was ready.
CLIENT_CLOSED_REQUEST = 499


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that stops on client disconnect.

    The stream runs in its own asyncio task; when the client disconnects it is cancelled
    once (plain asyncio cancellation, so the body generator's clean-up — aborting the
    engine requests — may still await), and the body generator is always closed.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[str, None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self.stream_response(send))
        disconnect = asyncio.create_task(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, disconnect):
                task.cancel()
            results = await asyncio.gather(stream, disconnect, return_exceptions=True)
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
        error = results[0]
        if isinstance(error, BaseException) and not isinstance(error, (asyncio.CancelledError, OSError)):
            logger.error("Streaming response failed", exc_info=error)


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Run a route handler (which takes ``raw_request``) until it returns or the client
    disconnects; on disconnect it is cancelled, so its engine requests are aborted."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        raw_request: Request = kwargs["raw_request"]
        handler_task = asyncio.ensure_future(handler(*args, **kwargs))
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({handler_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            handler_task.cancel()
            disconnect_task.cancel()
            raise
        disconnect_task.cancel()
        if handler_task.done():
            return handler_task.result()
        handler_task.cancel()
        await asyncio.gather(handler_task, return_exceptions=True)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    return wrapper


class AuthenticationMiddleware:
    """Requires ``Authorization: Bearer <key>``, with one of ``api_keys``, on every route but
    ``PUBLIC_PATHS`` and the chat page's (which asks for the key).

    Pure ASGI (not ``BaseHTTPMiddleware``), so streaming and disconnect detection pass
    through untouched. The key is compared with every accepted key (``secrets.compare_digest``).
    """

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self.api_keys = [key.encode("utf-8") for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_public(scope):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        authorization = headers.get("authorization")
        if self._key_matches(authorization) or self._key_matches(f"Bearer {headers.get('x-api-key', '')}"):
            await self.app(scope, receive, send)
            return
        message = (
            "Incorrect API key provided."
            if authorization or "x-api-key" in headers
            else "Missing API key: send it as 'Authorization: Bearer <key>'."
        )
        if self._route(scope).startswith(ANTHROPIC_PATH):
            response = anthropic_error_response(401, message)
        else:
            response = error_response(401, message, INVALID_REQUEST, None, "invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await logged_response(Request(scope), response, message)(scope, receive, send)

    @staticmethod
    def _route(scope: Scope) -> str:
        """The request's path below the app's ``root_path``."""
        path = scope.get("path", "")
        root_path = scope.get("root_path", "")
        if root_path and path.startswith(root_path):
            path = path[len(root_path) :]
        return path

    def _is_public(self, scope: Scope) -> bool:
        route = self._route(scope)
        return route.rstrip("/") in PUBLIC_PATHS or is_page_path(route)

    def _key_matches(self, authorization: Optional[str]) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        provided = token.strip().encode("utf-8")
        # NOTE: compare even when the scheme is wrong, so timing does not tell which failed.
        matches = [secrets.compare_digest(provided, key) for key in self.api_keys]
        return any(matches) and scheme.lower() == "bearer"


def _json(model: BaseModel) -> Response:
    return Response(content=model.model_dump_json(), media_type="application/json")


def _to_response(result: Union[BaseModel, dict, AsyncGenerator[str, None], Response]) -> Response:
    """A handler's result as the HTTP response: a ``Response`` as it is, a model or a dict as
    JSON, an async generator of SSE events as a stream."""
    if isinstance(result, Response):
        return result
    if isinstance(result, BaseModel):
        return _json(result)
    if isinstance(result, dict):
        return JSONResponse(result)
    return SSEResponse(result)


async def _log_stats_periodically(engine: EngineClient) -> None:
    """``engine.do_log_stats()`` every ``log_stats_interval()`` seconds, until cancelled
    (vLLM's server does the same)."""
    interval = log_stats_interval()
    while True:
        await asyncio.sleep(interval)
        await engine.do_log_stats()


def runtime_lora_updating_allowed() -> bool:
    """Whether adapters may be loaded and unloaded at run time: ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` (``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING`` or vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` turned on; ``pagedllm.envs``)."""
    return envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING.get()


def _add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """vLLM's runtime adapter routes: a JSON body in, the success text (200) or an OpenAI
    error out (``OpenAIServingModels.load_lora_adapter`` / ``unload_lora_adapter``)."""

    async def body_of(raw_request: Request) -> dict[str, Any]:
        try:
            body = await raw_request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.")
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw_request: Request) -> Response:
        return PlainTextResponse(models.load_lora_adapter(await body_of(raw_request)))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw_request: Request) -> Response:
        return PlainTextResponse(models.unload_lora_adapter(await body_of(raw_request)))


def _add_sleep_routes(app: FastAPI, engine: EngineClient) -> None:
    """vLLM's sleep-mode routes (``--enable-sleep-mode``; behind ``--api-key`` as the others):
    ``POST /sleep?level=1|2`` (returns once asleep: requests in flight finish first, new ones
    get 503 from the start), ``POST /wake_up`` (``?tags=weights&tags=kv_cache``; none: all),
    ``GET /is_sleeping`` -> ``{"is_sleeping": bool}`` (``AsyncLLM.sleep`` / ``wake_up``)."""

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        if level not in (1, 2):
            raise bad_request(f"level must be 1 or 2, got {level}.", param="level")
        await engine.sleep(level)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(raw_request: Request) -> Response:
        tags = raw_request.query_params.getlist("tags") or None
        unknown = sorted(set(tags or ()) - set(SLEEP_TAGS))
        if unknown:
            raise bad_request(f"Unknown tags {unknown}; the tags are {', '.join(SLEEP_TAGS)}.", param="tags")
        await engine.wake_up(tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await engine.is_sleeping()}


def build_app(engine: EngineClient, frontend: FrontendConfig, reported_args: Optional[list[str]] = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an ``AsyncLLM``; any ``EngineClient``) as ``frontend`` says;
    ``reported_args``: the ``pagedllm serve`` flags ``/server_info`` reports
    (``server_info.reported_serve_args``; None: not reported).

    ``frontend`` (see ``FrontendConfig``): ``served_model_name`` (list or None: the
    engine's model name), ``chat_template`` (the template text, already loaded by
    ``chat_utils.load_chat_template``, or None), ``chat_template_content_format`` (the format
    in use is logged here: ``chat_content_format.log_content_format``), ``api_key`` (a list of keys any of which
    is accepted, or None: no auth), ``disable_log_requests``, ``disable_log_stats`` (False:
    while the app runs, the engine's stats line is logged every ``log_stats_interval()``
    seconds), ``response_role``, ``enable_auto_tool_choice`` and ``tool_call_parser``
    (tool calling with ``tool_choice="auto"``), ``return_tokens_as_token_ids``,
    ``root_path`` (FastAPI's, for a path-based proxy), ``lora_modules``, ``disable_frontend``
    (no chat page at ``/``), and CORS as vLLM
    (Starlette's ``CORSMiddleware``): ``allowed_origins``, ``allowed_methods``,
    ``allowed_headers``, ``allow_credentials``.

    The caller owns the engine (``shutdown`` it after the server stops).
    """
    served_names = list(frontend.served_model_name or [engine.model_config.model])
    api_key = frontend.api_key
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    log_requests = not frontend.disable_log_requests
    tokenizer = engine.get_tokenizer()
    log_content_format(frontend.chat_template_content_format, template_text(tokenizer, frontend.chat_template))
    renderer = PromptRenderer(tokenizer, frontend.chat_template, image_placeholder(engine.model_config, tokenizer),
                              video_placeholder(engine.model_config), frontend.chat_template_content_format)
    model_config = engine.model_config
    models = OpenAIServingModels(
        served_names, str(getattr(model_config, "model_path", model_config.model)), model_config.max_model_len,
        frontend.lora_modules or (), getattr(engine.processor, "check_lora", None),
    )  # fmt: skip
    token_ids = frontend.return_tokens_as_token_ids
    admission = AdmissionControl(frontend.max_num_queued_reqs, frontend.max_num_queued_tokens, frontend.request_timeout,
                                 getattr(engine, "metrics_registry", None), served_names[0])
    completion = OpenAIServingCompletion(
        engine, models, renderer, log_requests=log_requests, return_tokens_as_token_ids=token_ids, admission=admission
    )
    chat = OpenAIServingChat(
        engine, models, renderer, log_requests=log_requests, return_tokens_as_token_ids=token_ids, admission=admission,
        response_role=frontend.response_role,
        tool_parser=frontend.tool_call_parser if frontend.enable_auto_tool_choice else None,
        reasoning_parser=frontend.reasoning_parser,
    )  # fmt: skip
    embedding = OpenAIServingEmbedding(engine, models, renderer, log_requests=log_requests)
    messages = AnthropicServingMessages(chat)
    classification = OpenAIServingClassification(engine, models, renderer, log_requests=log_requests)
    scores = OpenAIServingScores(engine, models, renderer, log_requests=log_requests)
    responses = OpenAIServingResponses(chat)
    tokenization = OpenAIServingTokenization(models, renderer, model_config.max_model_len, engine.processor.vocab_size)

    log_stats = not frontend.disable_log_stats

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        logger.info(
            "pagedllm %s serving %s as %s (max_model_len %d)",
            __version__, model_config.model, ", ".join(served_names), model_config.max_model_len,
        )  # fmt: skip
        stats_task = asyncio.create_task(_log_stats_periodically(engine)) if log_stats else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()

    root_path = frontend.root_path or ""
    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan, root_path=root_path)
    app.state.engine = engine
    register_exception_handlers(app)
    if api_keys:
        app.add_middleware(AuthenticationMiddleware, api_keys=api_keys)
    # NOTE: added last, so it runs first: CORS preflights are answered without an API key,
    # and 401 answers carry the CORS headers a browser needs to read them.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=frontend.allowed_origins,
        allow_methods=frontend.allowed_methods,
        allow_headers=frontend.allowed_headers,
        allow_credentials=frontend.allow_credentials,
    )

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine is alive; 503 once it has died."""
        if getattr(engine, "errored", False):
            return Response(status_code=503)
        try:
            await asyncio.wait_for(engine.check_health(), timeout=HEALTH_TIMEOUT_S)
        except Exception:  # EngineDeadError, or no answer in time
            return Response(status_code=503)
        return Response(status_code=200)

    if not frontend.disable_frontend:
        add_chat_page_routes(app)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format of the engine's metrics."""
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        registry = getattr(engine, "metrics_registry", None) or REGISTRY
        return Response(content=generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def get_server_info() -> dict[str, Any]:
        return server_info(reported_args, models, bool(api_keys))

    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json(models.list_models())

    @app.get("/v1/models/{model_id:path}")
    async def show_model(model_id: str) -> Response:
        if not model_id:  # "/v1/models/": the list, as "/health/" is "/health" (Starlette's redirect)
            return _json(models.list_models())
        return _json(models.show_model(model_id))

    if runtime_lora_updating_allowed():
        _add_lora_routes(app, models)
    if getattr(model_config, "enable_sleep_mode", False):
        _add_sleep_routes(app, engine)

    @app.post("/v1/completions")
    @with_cancellation
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return _to_response(await completion.create_completion(request, trace_headers_of(raw_request.headers)))

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return _to_response(await chat.create_chat_completion(request, trace_headers_of(raw_request.headers)))

    @app.post("/v1/responses")
    @with_cancellation
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return _to_response(await responses.create_response(request, trace_headers_of(raw_request.headers)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return JSONResponse(responses.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return JSONResponse(responses.delete(response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return JSONResponse(responses.cancel(response_id))

    if model_config.runner_type == "pooling":  # a generative model has no pooling routes (a 404)

        @app.post("/v1/embeddings")
        @with_cancellation
        async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
            return _json(await embedding.create_embedding(request))

        @app.post("/classify")
        @with_cancellation
        async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
            return _json(await classification.create_classify(request))

        @app.post("/score")
        @app.post("/v1/score")
        @with_cancellation
        async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
            return _json(await scores.create_score(request))

        @app.post("/rerank")
        @app.post("/v1/rerank")
        @app.post("/v2/rerank")
        @with_cancellation
        async def do_rerank(request: RerankRequest, raw_request: Request) -> Response:
            return _json(await scores.do_rerank(request))

    @app.post("/v1/messages")
    @with_cancellation
    async def create_messages(raw_request: Request) -> Response:
        return _to_response(await messages.create_messages(raw_request))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw_request: Request) -> Response:
        return await messages.count_tokens(raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        return _json(await tokenization.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return _json(await tokenization.detokenize(request))

    return app
