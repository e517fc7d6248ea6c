"""``OpenAIServing``: the base of every generating endpoint (vLLM's ``serving_engine``),
and what those endpoints share: prompts, SSE events, logprob helpers, merging streams.

Request path::

    request --PromptRenderer (tokenize / chat template)--> PromptInput
        --Processor.resolve_max_tokens, SamplingParams, Processor.process (validation, once)-->
        EngineCoreRequest --AsyncLLM.generate--> RequestOutput stream

Every input error is found by the ``Processor`` before anything reaches the engine and
becomes a 400 (a prompt that does not fit: vLLM's ``context_length_exceeded`` message).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Mapping, Optional, Sequence, TypeVar, Union

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.processor import ContextLengthError
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.admission import AdmissionControl, RequestTimeoutError
from pagedllm.entrypoints.openai.errors import (
    OpenAIServingError,
    bad_request,
    error_body,
    from_value_error,
)
from pagedllm.entrypoints.openai.protocol import SamplingRequest
from pagedllm.entrypoints.openai.renderer import PromptRenderer
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.tokenizer import byte_level_char_to_byte

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"

#: Request fields a ``SamplingParams`` error message may start with (they become ``param``).
SAMPLING_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "logit_bias", "max_completion_tokens", "cache_salt", "truncate_prompt_tokens",
    "allowed_token_ids", "bad_words", "priority",
)  # fmt: skip


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


#: Line breaks that JSON leaves unescaped inside strings but that line readers split on
#: (Python's ``str.splitlines``, so httpx's ``iter_lines``): sent as
#: ``\\uXXXX`` escapes, the same JSON value, so a generated token holding one cannot cut an event.
_UNSAFE_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: str, event: Optional[str] = None) -> str:
    """One Server-Sent Event carrying ``data`` (a JSON text), named ``event`` if given."""
    data = data.translate(_UNSAFE_LINE_BREAKS)
    return f"data: {data}\n\n" if event is None else f"event: {event}\ndata: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    """The SSE error event sent when a stream fails after its first byte."""
    if isinstance(exc, OpenAIServingError):
        body = error_body(exc.message, exc.err_type, exc.param, exc.code)
    elif isinstance(exc, EngineDeadError):
        body = error_body(f"The engine is dead and cannot serve requests: {exc}", "InternalServerError", code=500)
    else:
        body = error_body(f"Internal server error: {type(exc).__name__}: {exc}", "InternalServerError", code=500)
    return sse(json.dumps(body))


async def merge_async_iterators(
    iterators: Sequence[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several async generators as ``(index of the generator, item)``, as they come.

    The first exception of any generator is raised. Closing (or cancelling) the merged
    generator closes (or cancels) every input generator, so the engine aborts their
    requests; it returns only once they have handled it.
    """
    if len(iterators) == 1:
        only = iterators[0]
        try:
            async for item in only:
                yield 0, item
        finally:
            await only.aclose()
        return

    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(index: int, iterator: AsyncGenerator[T, None]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item, None))
        except Exception as exc:  # handed to the consumer
            queue.put_nowait((index, done, exc))
            return
        queue.put_nowait((index, done, None))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _raise(exc: BaseException) -> AsyncGenerator:
    """A stream whose first item is ``exc``, raised."""
    raise exc
    yield  # an async generator


async def _prepend(first: T, rest: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """``first``, then the items of ``rest``; closing it closes ``rest``."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


@dataclass
class PromptInput:
    """One tokenized prompt. ``text`` is the prompt as given (None for token ids);
    ``mm_features``: its images, processed (their placeholder tokens in ``token_ids``)."""

    text: Optional[str]
    token_ids: list[int]
    mm_features: Optional[list] = None

    @property
    def engine_prompt(self) -> Union[dict[str, Any], list[int]]:
        """What ``AsyncLLM.generate`` takes (already tokenized: it does not tokenize again)."""
        if self.text is None:
            return self.token_ids
        if self.mm_features:
            return {"prompt": self.text, "prompt_token_ids": self.token_ids, "mm_features": self.mm_features}
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


class OpenAIServing:
    """What every generating endpoint shares: the engine, model names, the prompt renderer,
    request validation (through the engine's ``Processor``), token texts and the engine call.

    Args:
        engine: an ``AsyncLLM`` (any ``EngineClient``: ``pagedllm.engine.protocol``).
        models: the served model names.
        renderer: tokenizer and chat template (shared with ``/tokenize``).
        log_requests: log one INFO line per request.
        return_tokens_as_token_ids: logprobs name tokens ``"token_id:{id}"`` instead of
            their text (vLLM's ``--return-tokens-as-token-ids``, for tokens that are not
            JSON-encodable text), unless a request's own field says otherwise.
        admission: the queue limits and request deadline (None: none).
    """

    def __init__(
        self,
        engine: EngineClient,
        models: OpenAIServingModels,
        renderer: PromptRenderer,
        *,
        log_requests: bool = True,
        return_tokens_as_token_ids: bool = False,
        admission: Optional[AdmissionControl] = None,
    ) -> None:
        self.engine = engine
        self.admission = admission or AdmissionControl()
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.processor = engine.processor
        self.models = models
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.max_model_len: int = engine.model_config.max_model_len
        self.log_requests = log_requests
        self._token_texts: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}
        self._byte_decoder = _byte_level_decoder(self.tokenizer)

    # ------------------------------------------------------------------ inputs

    def context_error(self, exc: ContextLengthError, prompt_param: str) -> OpenAIServingError:
        """The 400 for a request that does not fit in ``max_model_len`` (vLLM's message, which
        speaks of "the messages" for a chat and here of "the prompt" for a completion:
        ``prompt_param`` "prompt")."""
        num_prompt, num_completion = exc.num_prompt_tokens, exc.num_completion_tokens or 0
        what = "prompt" if prompt_param == "prompt" else "messages"
        return bad_request(
            f"This model's maximum context length is {exc.max_model_len} tokens. However, you "
            f"requested {num_prompt + num_completion} tokens ({num_prompt} in the {what}, "
            f"{num_completion} in the completion). Please reduce the length of the {what} or "
            f"completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )

    def engine_request(
        self,
        request_id: str,
        request: SamplingRequest,
        prompt: PromptInput,
        prompt_param: str,
        logprobs: Optional[int],
        prompt_logprobs: Optional[int],
    ) -> EngineCoreRequest:
        """Validate one prompt of a request and build its engine request (validation runs
        once, in the engine's ``Processor``).

        The request's ``max_tokens`` and its default are resolved by
        ``Processor.resolve_max_tokens``; sampling fields it leaves out take the model's
        defaults (``Processor.default_sampling_params``). ``prompt_param`` names the prompt
        field in error messages.

        Raises:
            OpenAIServingError: 400 for a bad field, prompt, or a prompt that does not fit.
        """
        try:
            num_prompt_tokens = len(self.processor.truncate_prompt(prompt.token_ids, request.truncate_prompt_tokens))
            max_tokens = self.processor.resolve_max_tokens(
                num_prompt_tokens, request.requested_max_tokens, request.default_max_tokens, request.max_tokens_param
            )
            params = request.to_sampling_params(
                max_tokens, logprobs, prompt_logprobs, self.processor.default_sampling_params
            )
            engine_request, _ = self.processor.process(
                request_id, prompt.engine_prompt, params, None, request.cache_salt, self.models.lora_request(request.model),
                request.priority,
            )
        except ContextLengthError as exc:
            error = self.context_error(exc, prompt_param)
        except ValueError as exc:
            error = from_value_error(exc, SAMPLING_FIELDS)
        except FileNotFoundError as exc:  # the adapter's files are gone since it was loaded
            error = bad_request(str(exc), param="model")
        else:
            return engine_request
        error.request_id = request_id
        raise error from None

    # ------------------------------------------------------------------ engine

    def generate(
        self, request_id: str, prompts: Sequence[PromptInput], requests: Sequence[EngineCoreRequest],
        trace_headers: Optional[Mapping[str, str]] = None,
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, RequestOutput) of one engine request per prompt (built by
        ``engine_request``, ids ``{request_id}-{i}``). Nothing reaches the engine until it
        is iterated; past the request's deadline it raises ``RequestTimeoutError``.
        ``trace_headers``: the HTTP request's W3C trace context (``pagedllm.tracing.trace_headers_of``),
        the parent of every engine request's span when tracing is on.

        Raises:
            OpenAIServingError: 429 when queuing the requests passes a queue limit.
        """
        self.admission.check(self.engine, requests)
        if self.log_requests:
            logging.getLogger(type(self).__module__).info(  # the endpoint's own logger
                "Received request %s: %d prompt(s) of %s tokens, params: %s",
                request_id, len(prompts), [len(p.token_ids) for p in prompts], requests[0].sampling_params,
            )  # fmt: skip
        generators = [
            self.engine.generate(
                request, request.sampling_params, request.request_id, prompt_text=prompt.text, trace_headers=trace_headers
            )
            for prompt, request in zip(prompts, requests)
        ]
        return self.admission.with_deadline(merge_async_iterators(generators))

    @staticmethod
    async def collect_final(
        stream: AsyncGenerator[tuple[int, RequestOutput], None], num_prompts: int
    ) -> list[RequestOutput]:
        """The last output of every prompt (the final one, for FINAL_ONLY requests).

        Raises:
            OpenAIServingError: 400 when the engine rejects the input (``ValueError``).
            EngineDeadError: when the engine dies meanwhile (a 500).
        """
        finals: dict[int, RequestOutput] = {}
        try:
            async for index, output in stream:
                finals[index] = output
        except ValueError as exc:
            raise from_value_error(exc, SAMPLING_FIELDS) from None
        finally:
            await stream.aclose()
        missing = [i for i in range(num_prompts) if i not in finals]
        if missing:
            raise RuntimeError(f"The engine returned no output for prompt(s) {missing}.")
        for output in finals.values():
            _raise_kv_transfer_error(output)
        return [finals[i] for i in range(num_prompts)]

    @staticmethod
    async def start_stream(
        stream: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Wait for the first output, so input errors are still plain 400/500 responses.

        Returns the stream with that output put back in front.
        """
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return stream
        except RequestTimeoutError as exc:  # a stream's error: sent as its error event
            return _raise(exc)
        except ValueError as exc:
            await stream.aclose()
            raise from_value_error(exc, SAMPLING_FIELDS) from None
        except BaseException:
            await stream.aclose()
            raise
        try:
            _raise_kv_transfer_error(first[1])
        except OpenAIServingError:
            await stream.aclose()
            raise
        return _prepend(first, stream)

    @staticmethod
    async def sse_stream(
        request_id: str,
        events: AsyncGenerator[str, None],
        stream: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncGenerator[str, None]:
        """``events``, then ``data: [DONE]``. An error is sent as one error event (400 for
        input the engine rejects, else 500). Closing it closes ``stream``, which aborts
        the engine requests."""
        try:
            async for event in events:
                yield event
        except ValueError as exc:
            yield sse_error(from_value_error(exc, SAMPLING_FIELDS))
        except Exception as exc:
            if not isinstance(exc, (EngineDeadError, OpenAIServingError)):
                logger.exception("Stream %s failed", request_id)
            yield sse_error(exc)
        finally:
            await events.aclose()
            await stream.aclose()
        yield SSE_DONE

    # ------------------------------------------------------------------ token texts

    def tokens_as_ids(self, request: SamplingRequest) -> bool:
        """Whether ``request``'s logprobs name tokens ``"token_id:{id}"``: its own
        ``return_tokens_as_token_ids`` when set, else the server's (vLLM's rule)."""
        if request.return_tokens_as_token_ids is not None:
            return request.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids

    def token_text(self, token_id: int, logprob: Optional[Logprob] = None, as_id: bool = False) -> str:
        """A token's text alone (special tokens included), as logprobs report it, or
        ``"token_id:{id}"`` with ``as_id`` (see ``tokens_as_ids``)."""
        if as_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) or ""
            self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """A token's UTF-8 bytes; for byte-level BPE the exact bytes, even of a token
        holding part of a character (whose text is U+FFFD)."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        data: Optional[bytes] = None
        if self._byte_decoder is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in self._byte_decoder for ch in piece):
                data = bytes(self._byte_decoder[ch] for ch in piece)
        if data is None:
            data = self.token_text(token_id).encode("utf-8")
        self._token_bytes[token_id] = list(data)
        return self._token_bytes[token_id]


def _raise_kv_transfer_error(output: RequestOutput) -> None:
    """Raise for a decode instance's request whose prompt KV could not be loaded (its
    ``kv_transfer_params`` carry the error): a 503 when sending it again may work (the
    prefill instance is gone, or no longer holds the KV), a 500 with ``code``
    ``kv_layout_mismatch`` when it cannot (``"retryable": false``: the two instances' KV
    layouts differ). A pooling output (``PoolingRequestOutput``) carries none."""
    if not isinstance(output, RequestOutput):
        return
    params = output.kv_transfer_params or {}
    error = params.get("error")
    if error is None:
        return
    if params.get("retryable", True):
        raise OpenAIServingError(f"{error}; send the request to a prefill instance again.", 503)
    raise OpenAIServingError(f"{error} Sending the request again does not help.", 500, code="kv_layout_mismatch")


def _byte_level_decoder(tokenizer: Any) -> Optional[dict[str, int]]:
    """GPT-2's printable-character -> byte map, when ``tokenizer`` is byte-level BPE."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        # the decoder's JSON alone (what pickling it writes), not the whole tokenizer's:
        # a 150k-token vocabulary's took 0.09 s per serving class at start-up
        decoder = backend.decoder
        decoder_json = b"" if decoder is None else decoder.__getstate__()
    except Exception:  # a decoder that cannot be serialised: fall back to decoded text
        return None
    if b"ByteLevel" not in decoder_json:
        return None
    return byte_level_char_to_byte()


__all__ = ["OpenAIServing", PromptInput, "merge_async_iterators"]
