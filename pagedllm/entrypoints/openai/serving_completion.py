"""``POST /v1/completions``, and ``OpenAIServing``, the base of every generating endpoint.

Request path (vLLM's OpenAI layer)::

    CompletionRequest --tokenize, check context + params--> N prompts x SamplingParams
        --AsyncLLM.generate (one engine request per prompt, n choices inside)-->
        merge_async_iterators --> (prompt index, RequestOutput)
        --> one JSON response (FINAL_ONLY outputs), or SSE chunks (DELTA outputs)

Choice ``index`` is ``prompt_index * n + i``. Streams end with ``data: [DONE]``; an error
after the first byte is sent as one ``data: {"error": ...}`` event before ``[DONE]``.
Cancelling or closing a stream (client disconnect) closes the engine generators, which
aborts the requests in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Optional, Sequence, TypeVar, Union

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.entrypoints.openai.errors import (
    OpenAIServingError,
    bad_request,
    error_body,
    from_value_error,
)
from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    LogprobInfo,
    PromptLogprobsJSON,
    SamplingRequest,
    UsageInfo,
    make_usage,
)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.outputs import CompletionOutput, Logprob, PositionLogprobs, PromptLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Logprobs are clamped to this floor so the JSON never holds -inf (as vLLM and OpenAI).
MIN_LOGPROB = -9999.0
#: Default ``max_tokens`` of ``/v1/completions`` (OpenAI's).
DEFAULT_COMPLETION_MAX_TOKENS = 16
SSE_DONE = "data: [DONE]\n\n"

#: Request fields a ``SamplingParams`` error message may start with (they become ``param``).
SAMPLING_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "logit_bias",
)  # fmt: skip


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: str) -> str:
    """One Server-Sent Event carrying ``data`` (a JSON text)."""
    return f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    """The SSE error event sent when a stream fails after its first byte."""
    if isinstance(exc, OpenAIServingError):
        body = error_body(exc.message, exc.err_type, exc.param, exc.code)
    elif isinstance(exc, EngineDeadError):
        body = error_body(f"The engine is dead and cannot serve requests: {exc}", "InternalServerError", code=500)
    else:
        body = error_body(f"Internal server error: {type(exc).__name__}: {exc}", "InternalServerError", code=500)
    return sse(json.dumps(body))


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def top_entries(position: PositionLogprobs, num: int) -> list[tuple[int, Logprob]]:
    """The ``num`` most likely tokens of one position, most likely first."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num]
    ranked.sort(key=lambda item: item[1].rank or 0)
    return ranked


def prompt_logprobs_json(prompt_logprobs: Optional[PromptLogprobs]) -> Optional[PromptLogprobsJSON]:
    """vLLM's ``prompt_logprobs`` field: per prompt token, None or ``{id: {logprob, rank, decoded_token}}``."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            tid: LogprobInfo(logprob=clamp_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in position.items()
        }
        for position in prompt_logprobs
    ]


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
    """One tokenized prompt. ``text`` is the prompt as given (None for token ids)."""

    text: Optional[str]
    token_ids: list[int]

    @property
    def engine_prompt(self) -> Union[dict[str, Any], list[int]]:
        """What ``AsyncLLM.generate`` takes (already tokenized: it does not tokenize again)."""
        if self.text is None:
            return self.token_ids
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


class OpenAIServing:
    """What every generating endpoint shares: the engine, model names, tokenizer, context
    checks, ``SamplingParams``, token texts and the engine call.

    Args:
        engine: an ``AsyncLLM`` (see ``pagedllm.engine.async_llm``).
        models: the served model names.
        tokenizer: the engine's HF tokenizer.
        log_requests: log one INFO line per request.
    """

    def __init__(self, engine: Any, models: OpenAIServingModels, tokenizer: Any, *, log_requests: bool = True) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer
        self.max_model_len: int = engine.model_config.max_model_len
        self.log_requests = log_requests
        self._token_texts: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}
        self._byte_decoder = _byte_level_decoder(tokenizer)

    # ------------------------------------------------------------------ inputs

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def context_error(self, num_prompt: int, num_completion: int, prompt_param: str) -> OpenAIServingError:
        """The 400 for a request that does not fit in ``max_model_len`` (vLLM's message)."""
        return bad_request(
            f"This model's maximum context length is {self.max_model_len} tokens. However, you "
            f"requested {num_prompt + num_completion} tokens ({num_prompt} in the messages, "
            f"{num_completion} in the completion). Please reduce the length of the messages or "
            f"completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )

    def max_tokens_for(
        self, num_prompt: int, requested: Optional[int], default: Optional[int], param: str, prompt_param: str
    ) -> int:
        """The ``max_tokens`` to generate for a prompt of ``num_prompt`` tokens.

        ``requested`` (explicit) must fit with the prompt; when None, ``default`` (None:
        the rest of the context) is cut to what fits. ``param`` and ``prompt_param`` name
        the request fields in error messages.

        Raises:
            OpenAIServingError: 400 when it does not fit or ``requested`` < 1.
        """
        room = self.max_model_len - num_prompt
        if requested is not None:
            if requested < 1:
                raise bad_request(f"{param} must be at least 1, got {requested}.", param=param)
            if requested > room:
                raise self.context_error(num_prompt, requested, prompt_param)
            return requested
        if room < 1:
            raise self.context_error(num_prompt, default or 1, prompt_param)
        return room if default is None else min(default, room)

    def sampling_params(
        self, request: SamplingRequest, max_tokens: int, logprobs: Optional[int], prompt_logprobs: Optional[int]
    ) -> SamplingParams:
        """Raises: OpenAIServingError (400) for a field out of range."""
        try:
            return request.to_sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ValueError as exc:
            raise from_value_error(exc, SAMPLING_FIELDS) from None

    def validate_prompt(self, prompt: PromptInput, params: SamplingParams) -> None:
        """The engine's checks (empty prompt, token ids outside the vocabulary), as a 400."""
        try:
            self.engine.processor.validate(prompt.token_ids, params)
        except ValueError as exc:
            raise from_value_error(exc, SAMPLING_FIELDS) from None

    # ------------------------------------------------------------------ engine

    def generate(
        self,
        request_id: str,
        prompts: Sequence[PromptInput],
        params: Sequence[SamplingParams],
        cache_salt: Optional[str],
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, RequestOutput) of one engine request per prompt (ids
        ``{request_id}-{i}``). Nothing reaches the engine until it is iterated."""
        if self.log_requests:
            logger.info(
                "Received request %s: %d prompt(s) of %s tokens, params: %s",
                request_id, len(prompts), [len(p.token_ids) for p in prompts], params[0],
            )  # fmt: skip
        generators = [
            self.engine.generate(prompt.engine_prompt, p, f"{request_id}-{i}", cache_salt=cache_salt)
            for i, (prompt, p) in enumerate(zip(prompts, params))
        ]
        return merge_async_iterators(generators)

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
        except ValueError as exc:
            await stream.aclose()
            raise from_value_error(exc, SAMPLING_FIELDS) from None
        except BaseException:
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
            if not isinstance(exc, EngineDeadError):
                logger.exception("Stream %s failed", request_id)
            yield sse_error(exc)
        finally:
            await events.aclose()
            await stream.aclose()
        yield SSE_DONE

    # ------------------------------------------------------------------ token texts

    def token_text(self, token_id: int, logprob: Optional[Logprob] = None) -> str:
        """A token's text alone (special tokens included), as logprobs report it."""
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


def _byte_level_decoder(tokenizer: Any) -> Optional[dict[str, int]]:
    """GPT-2's printable-character -> byte map, when ``tokenizer`` is byte-level BPE."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # a tokenizer that cannot be serialised: fall back to decoded text
        return None
    if "ByteLevel" not in json.dumps(decoder):
        return None
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(ch): byte for byte, ch in zip(printable, chars)}


class OpenAIServingCompletion(OpenAIServing):
    """``POST /v1/completions``."""

    async def create_completion(
        self, request: CompletionRequest
    ) -> Union[CompletionResponse, AsyncGenerator[str, None]]:
        """A ``CompletionResponse``, or (``stream``) an async generator of SSE events.

        Raises:
            OpenAIServingError: 400 for bad input, 404 for an unknown model.
            EngineDeadError: the engine died (a 500).
        """
        model_name = self.models.resolve(request.model)
        prompts = self._prompt_inputs(request)
        explicit_max = request.max_tokens if "max_tokens" in request.model_fields_set else None
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        params = []
        for prompt in prompts:
            max_tokens = self.max_tokens_for(
                len(prompt.token_ids), explicit_max, DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens", "prompt"
            )
            prompt_params = self.sampling_params(request, max_tokens, request.logprobs, prompt_logprobs)
            self.validate_prompt(prompt, prompt_params)
            params.append(prompt_params)
        request_id = random_id("cmpl")
        stream = self.generate(request_id, prompts, params, request.cache_salt)
        if request.stream:
            stream = await self.start_stream(stream)
            events = self._stream(request, request_id, model_name, prompts, stream)
            return self.sse_stream(request_id, events, stream)
        finals = await self.collect_final(stream, len(prompts))
        return self._response(request, request_id, model_name, prompts, finals)

    def _prompt_inputs(self, request: CompletionRequest) -> list[PromptInput]:
        prompt = request.prompt
        if isinstance(prompt, str):
            texts: list[str] = [prompt]
        elif prompt and isinstance(prompt[0], str):
            texts = list(prompt)  # type: ignore[arg-type]
        elif prompt and isinstance(prompt[0], list):
            return [PromptInput(None, list(ids)) for ids in prompt]  # type: ignore[arg-type]
        else:
            return [PromptInput(None, list(prompt))]  # type: ignore[arg-type]
        return [PromptInput(text, self.encode(text, request.add_special_tokens)) for text in texts]

    def _echo_text(self, prompt: PromptInput) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _logprobs(
        self,
        token_ids: Sequence[int],
        positions: Sequence[Optional[PositionLogprobs]],
        num_top: int,
        initial_offset: int,
    ) -> CompletionLogProbs:
        """OpenAI's completions logprobs. ``top_logprobs`` holds the ``num_top`` most likely
        tokens plus the chosen one; a position without logprobs (the first prompt token)
        has nulls."""
        result = CompletionLogProbs()
        offset = initial_offset
        for token_id, position in zip(token_ids, positions):
            chosen = position.get(token_id) if position else None
            token = self.token_text(token_id, chosen)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if chosen is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(clamp_logprob(chosen.logprob))
            top = {self.token_text(tid, lp): clamp_logprob(lp.logprob) for tid, lp in top_entries(position, num_top)}
            top.setdefault(token, clamp_logprob(chosen.logprob))
            result.top_logprobs.append(top)
        return result

    def _choice_logprobs(
        self,
        request: CompletionRequest,
        prompt: PromptInput,
        prompt_logprobs: Optional[PromptLogprobs],
        token_ids: list[int],
        positions: Optional[list[PositionLogprobs]],
        with_prompt: bool,
        initial_offset: int,
    ) -> Optional[CompletionLogProbs]:
        if request.logprobs is None:
            return None
        all_ids: list[int] = list(token_ids)
        all_positions: list[Optional[PositionLogprobs]] = list(positions or [None] * len(token_ids))
        if with_prompt:
            prompt_positions = list(prompt_logprobs or [])
            prompt_positions += [None] * (len(prompt.token_ids) - len(prompt_positions))
            all_ids = prompt.token_ids + all_ids
            all_positions = prompt_positions + all_positions
        return self._logprobs(all_ids, all_positions, request.logprobs, initial_offset)

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        prompts: list[PromptInput],
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        choices = []
        num_prompt_tokens = num_generated = num_cached = 0
        for prompt_index, (prompt, final) in enumerate(zip(prompts, finals)):
            num_prompt_tokens += len(final.prompt_token_ids)
            num_cached += final.num_cached_tokens
            for output in final.outputs:
                num_generated += len(output.token_ids)
                text = self._echo_text(prompt) + output.text if request.echo else output.text
                logprobs = self._choice_logprobs(
                    request, prompt, final.prompt_logprobs, output.token_ids, output.logprobs, request.echo, 0
                )
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_index * request.n + output.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                        prompt_logprobs=(
                            prompt_logprobs_json(final.prompt_logprobs) if request.prompt_logprobs is not None else None
                        ),
                    )
                )
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=make_usage(num_prompt_tokens, num_generated, num_cached),
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        prompts: list[PromptInput],
        stream: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncGenerator[str, None]:
        state = _StreamState(request, request_id, model_name, prompts)
        async for prompt_index, output in stream:
            state.num_cached[prompt_index] = output.num_cached_tokens or state.num_cached[prompt_index]
            state.prompt_logprobs[prompt_index].extend(output.prompt_logprobs or [])
            for completion in output.outputs:
                event = self._stream_event(request, state, prompt_index, completion)
                if event is not None:
                    yield event
        if request.include_usage:
            yield state.event([], state.usage())

    def _stream_event(
        self, request: CompletionRequest, state: "_StreamState", prompt_index: int, completion: CompletionOutput
    ) -> Optional[str]:
        """The SSE event of one choice's new output, or None when it carries nothing."""
        prompt = state.prompts[prompt_index]
        index = prompt_index * request.n + completion.index
        first = not state.started[index]
        state.started[index] = True
        state.num_generated[index] += len(completion.token_ids)
        echo = first and request.echo
        text = self._echo_text(prompt) + completion.text if echo else completion.text
        logprobs = self._choice_logprobs(
            request, prompt, state.prompt_logprobs[prompt_index], completion.token_ids, completion.logprobs,
            echo, state.offsets[index],
        )  # fmt: skip
        if logprobs is not None and not logprobs.tokens:
            logprobs = None
        if logprobs is not None:
            state.offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if not text and logprobs is None and completion.finish_reason is None:
            return None
        send_prompt_logprobs = first and request.prompt_logprobs is not None
        choice = CompletionResponseStreamChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_logprobs=prompt_logprobs_json(state.prompt_logprobs[prompt_index]) if send_prompt_logprobs else None,
        )
        return state.event([choice], state.usage() if request.continuous_usage else None)


class _StreamState:
    """What a streamed completions request has sent so far, per choice and per prompt."""

    def __init__(self, request: CompletionRequest, request_id: str, model_name: str, prompts: list[PromptInput]) -> None:
        num_choices = len(prompts) * request.n
        self.request_id = request_id
        self.model_name = model_name
        self.created = int(time.time())
        self.prompts = prompts
        self.started = [False] * num_choices
        self.offsets = [0] * num_choices  # text_offset of each choice's next token
        self.num_generated = [0] * num_choices
        self.num_cached = [0] * len(prompts)
        self.prompt_logprobs: list[PromptLogprobs] = [[] for _ in prompts]
        self.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        # NOTE: without include_usage the "usage" key is left out, as OpenAI does.
        self.exclude = None if request.include_usage or request.continuous_usage else {"usage"}

    def usage(self) -> UsageInfo:
        return make_usage(self.num_prompt_tokens, sum(self.num_generated), sum(self.num_cached))

    def event(self, choices: list[CompletionResponseStreamChoice], usage: Optional[UsageInfo]) -> str:
        chunk = CompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )
        return sse(chunk.model_dump_json(exclude=None if not choices else self.exclude))


__all__ = ["OpenAIServing", "OpenAIServingCompletion", "PromptInput", "merge_async_iterators"]
