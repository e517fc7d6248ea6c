"""``GenerationServicer``: the ``pagedllm.v1.Generation`` service (``pagedllm_generation.proto``)
over an ``EngineClient`` (the ``AsyncLLM`` that serves HTTP too).

- Generate: the prompt (text or token ids) and its sampling fields become one engine request
  exactly as a ``/v1/completions`` request does: unset fields take the model's defaults
  (``Processor.default_sampling_params``), ``max_tokens`` defaults to 16 cut to the room the
  prompt leaves (``Processor.resolve_max_tokens``), and ``Processor.process`` validates it;
  outputs stream as deltas (``RequestOutputKind.DELTA``), one message per completion per step.
- Errors: a ``ValueError`` of that validation (a field out of range, a prompt that does not
  fit) is ``INVALID_ARGUMENT`` with its message; a request id already running
  ``ALREADY_EXISTS``; a dead or stopping engine ``UNAVAILABLE``; a missing or wrong API key
  (``--api-key``, sent as metadata ``authorization: Bearer <key>``) ``UNAUTHENTICATED`` on
  every method but Health, as HTTP's ``/health`` is open.
- A call cancelled by its client aborts its request in the engine (``AsyncLLM.generate``).
- Metadata ``traceparent`` / ``tracestate`` (W3C trace context) make the request's span a
  child of the caller's (with ``--otlp-traces-endpoint``; ``pagedllm.tracing``).
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from typing import Any, AsyncIterator, Optional, Sequence

import grpc

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.grpc.stubs import load_stubs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tracing import trace_headers_of
from pagedllm.version import __version__

#: Optional scalar fields of the proto's ``SamplingParams``, named as pagedllm's.
OPTIONAL_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos", "seed", "skip_special_tokens", "include_stop_str_in_output",
)  # fmt: skip
#: Seconds Health waits for ``EngineClient.check_health`` (as ``/health``).
HEALTH_TIMEOUT_S = 5.0

_messages, _services = load_stubs()


def sampling_fields(params: Any) -> dict[str, Any]:
    """The fields a proto ``SamplingParams`` sets, as ``SamplingParams`` keywords (unset: None;
    empty ``stop`` / ``stop_token_ids``: None); ``max_tokens`` apart (see ``Generate``)."""
    fields = {name: getattr(params, name) if params.HasField(name) else None for name in OPTIONAL_FIELDS}
    fields["stop"] = list(params.stop) or None
    fields["stop_token_ids"] = list(params.stop_token_ids) or None
    return fields


class GenerationServicer(_services.GenerationServicer):
    """The service's four methods over ``engine`` (see the module docstring).

    Args:
        engine: the server's ``AsyncLLM`` (any ``EngineClient``).
        served_model_names: the names ModelInfo reports (the first is the one reported).
        api_keys: keys one of which every call but Health must send; empty: no check.
    """

    def __init__(self, engine: EngineClient, served_model_names: Sequence[str], api_keys: Sequence[str] = ()) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.api_keys = [key.encode("utf-8") for key in api_keys]
        #: Ids of the requests Generate is serving now (the ones Abort may end).
        self.running: set[str] = set()

    async def _check_key(self, context: grpc.aio.ServicerContext) -> None:
        if not self.api_keys:
            return
        metadata = dict(context.invocation_metadata() or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        provided = token.strip().encode("utf-8")
        matches = [secrets.compare_digest(provided, key) for key in self.api_keys]
        if not (any(matches) and scheme.lower() == "bearer"):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "Missing or incorrect API key: send 'authorization: Bearer <key>'.")

    def _engine_request(self, request_id: str, request: Any) -> tuple[Any, Optional[str], int]:
        """The validated engine request, the prompt's text and its token count.

        Raises:
            ValueError: no prompt, or a bad field or prompt (the processor's message).
        """
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ValueError("prompt: set text or token_ids.")
        prompt = request.text if kind == "text" else {"prompt_token_ids": list(request.token_ids.ids)}
        processor = self.engine.processor
        prompt_text, token_ids = processor.tokenize_prompt(prompt)
        params = request.sampling_params
        max_tokens = processor.resolve_max_tokens(
            len(token_ids), params.max_tokens if params.HasField("max_tokens") else None
        )
        sampling_params = SamplingParams.from_optional(
            processor.default_sampling_params, **sampling_fields(params), max_tokens=max_tokens,
            output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        cache_salt = request.cache_salt if request.HasField("cache_salt") else None
        engine_request, _ = processor.process(
            request_id, {"prompt_token_ids": token_ids}, sampling_params, None, cache_salt
        )
        return engine_request, prompt_text, len(engine_request.prompt_token_ids)

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await self._check_key(context)
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        if request_id in self.running:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"Request id {request_id!r} is already running.")
        try:
            engine_request, prompt_text, num_prompt_tokens = self._engine_request(request_id, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.running.add(request_id)
        completion_tokens: dict[int, int] = {}
        try:
            trace_headers = trace_headers_of(dict(context.invocation_metadata() or ()))
            outputs = self.engine.generate(
                engine_request, None, request_id, prompt_text=prompt_text, trace_headers=trace_headers
            )
            async for output in outputs:
                for completion in output.outputs:
                    count = completion_tokens.get(completion.index, 0) + len(completion.token_ids)
                    completion_tokens[completion.index] = count
                    yield _messages.GenerateResponse(
                        request_id=request_id, index=completion.index, text=completion.text,
                        token_ids=completion.token_ids, finished=completion.finish_reason is not None,
                        finish_reason=completion.finish_reason or "", prompt_tokens=num_prompt_tokens,
                        completion_tokens=count,
                    )  # fmt: skip
        except ValueError as exc:  # e.g. the id is already running over HTTP
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # the shutdown's "server is shutting down" (503), or a bug
            code = grpc.StatusCode.UNAVAILABLE if getattr(exc, "status_code", None) == 503 else grpc.StatusCode.INTERNAL
            await context.abort(code, str(exc))
        finally:
            self.running.discard(request_id)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_key(context)
        aborted = [request_id for request_id in dict.fromkeys(request.request_ids) if request_id in self.running]
        if aborted:
            await self.engine.abort(aborted)
        return _messages.AbortResponse(aborted=aborted)

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            await asyncio.wait_for(self.engine.check_health(), timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:  # EngineDeadError, or no answer in time
            return _messages.HealthResponse(healthy=False, message=str(exc) or "The engine did not answer.")
        return _messages.HealthResponse(healthy=True, message="OK")

    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_key(context)
        config = self.engine.model_config
        return _messages.ModelInfoResponse(
            served_model_names=self.served_model_names, model=str(config.model),
            max_model_len=config.max_model_len, vocab_size=self.engine.processor.vocab_size, version=__version__,
        )  # fmt: skip
