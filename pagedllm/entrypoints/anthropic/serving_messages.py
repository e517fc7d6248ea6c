"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API
over the chat completions path (``conversion``: the request; ``OpenAIServingChat``: the
engine run, tool calls and reasoning).

The reply's ``content`` is, in order: a ``thinking`` block (the reasoning, with
``--reasoning-parser``; ``signature`` ""), a ``text`` block (when there is text, or nothing
else), one ``tool_use`` block per call (``input``: the arguments' JSON, ``{}`` when cut
off). ``stop_reason``: "tool_use" when calls were made, "max_tokens" for a length stop,
"stop_sequence" (with ``stop_sequence``) when one of ``stop_sequences`` ended it, else
"end_turn". ``usage``: ``input_tokens`` (the prompt) and ``output_tokens``.

A stream sends Anthropic's events (``event: NAME`` + ``data: JSON``): ``message_start``
(usage with the prompt's tokens), per block ``content_block_start``, its
``content_block_delta`` events (``thinking_delta``, ``text_delta``, ``input_json_delta``)
and ``content_block_stop``; then ``message_delta`` (``stop_reason``, ``stop_sequence``,
``usage.output_tokens``) and ``message_stop``. A failure after the first event is one
``error`` event.

Errors are Anthropic's JSON, ``{"type": "error", "error": {"type", "message"}}``, with the
status (``ERROR_TYPES``).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, AsyncGenerator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.entrypoints.anthropic.conversion import chat_request
from pagedllm.entrypoints.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicError,
    AnthropicErrorResponse,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
    AnthropicUsage,
)
from pagedllm.entrypoints.openai.errors import OpenAIServingError, from_value_error, validation_error_message
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatResponseMessage,
    DeltaToolCall,
)
from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import SAMPLING_FIELDS, sse
from pagedllm.tracing import trace_headers_of

logger = logging.getLogger(__name__)

#: HTTP status -> Anthropic's error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(status_code: int, message: str) -> dict[str, Any]:
    """Anthropic's error JSON for ``status_code``."""
    error = AnthropicError(type=ERROR_TYPES.get(status_code, "api_error"), message=message)
    return AnthropicErrorResponse(error=error).model_dump()


def error_response(status_code: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status_code, message), status_code=status_code)


def _failure(exc: BaseException) -> tuple[int, str]:
    """(status, message) of an error while serving a Messages request."""
    if isinstance(exc, OpenAIServingError):
        return exc.status_code, exc.message
    if isinstance(exc, ValueError):
        return 400, from_value_error(exc, SAMPLING_FIELDS).message
    if isinstance(exc, EngineDeadError):
        return 500, f"The engine is dead and cannot serve requests: {exc}"
    logger.error("Messages request failed", exc_info=exc)
    return 500, f"Internal server error: {type(exc).__name__}: {exc}"


def sse_event(name: str, data: dict[str, Any]) -> str:
    """One Server-Sent Event of Anthropic's stream: ``data`` carries ``type`` ``name``."""
    return sse(json.dumps({"type": name, **data}, ensure_ascii=False), event=name)


def anthropic_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as ``input``: the JSON object, ``{}`` when it is not one."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(
    request: AnthropicMessagesRequest, finish_reason: Optional[str], engine_stop: Any, called: bool
) -> tuple[str, Optional[str]]:
    """(``stop_reason``, ``stop_sequence``) of a reply (module docstring)."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop, str) and engine_stop in (request.stop_sequences or ()):
        return "stop_sequence", engine_stop
    return "end_turn", None


class AnthropicServingMessages:
    """The Messages endpoints over ``chat`` (the server's ``OpenAIServingChat``)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def parse(self, raw_request: Request, model: type[BaseModel]) -> Any:
        """The validated body.

        Raises:
            OpenAIServingError: 400 for a body that is not JSON or does not validate.
        """
        try:
            body = await raw_request.json()
        except ValueError:
            raise OpenAIServingError("The body is not valid JSON.") from None
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            raise OpenAIServingError(validation_error_message(list(exc.errors()))[0]) from None

    async def create_messages(self, raw_request: Request) -> Union[JSONResponse, AsyncGenerator[str, None]]:
        """The reply as JSON (an error's too), or (``stream``) the generator of its events.
        The request's W3C trace context headers are the parent of its span (tracing on)."""
        try:
            request: AnthropicMessagesRequest = await self.parse(raw_request, AnthropicMessagesRequest)
            chat = chat_request(request)
            run = self.chat.start(chat, anthropic_id("msg"), trace_headers_of(raw_request.headers))
            if request.stream:
                run.stream = await self.chat.start_stream(run.stream)
                return self._events(request, chat, run)
            (final,) = await self.chat.collect_final(run.stream, 1)
        except Exception as exc:
            return error_response(*_failure(exc))
        response = self.chat.response(chat, run, final)
        choice, usage = response.choices[0], response.usage
        called = bool(choice.message.tool_calls)
        reason, sequence = stop_reason(request, choice.finish_reason, choice.stop_reason, called)
        message = AnthropicMessagesResponse(
            id=run.request_id, model=run.model_name, content=self._blocks(choice.message), stop_reason=reason,
            stop_sequence=sequence,
            usage=AnthropicUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens),
        )  # fmt: skip
        return JSONResponse(message.model_dump())

    async def count_tokens(self, raw_request: Request) -> JSONResponse:
        """``{"input_tokens": N}``: the prompt's tokens as ``/v1/messages`` would render it."""
        try:
            request: AnthropicCountTokensRequest = await self.parse(raw_request, AnthropicCountTokensRequest)
            chat = chat_request(request)
            self.chat.models.resolve(chat.model)
            prompt = self.chat.render_prompt(chat)
        except Exception as exc:
            return error_response(*_failure(exc))
        return JSONResponse(AnthropicCountTokensResponse(input_tokens=len(prompt.token_ids)).model_dump())

    @staticmethod
    def _blocks(message: ChatResponseMessage) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if message.reasoning:
            blocks.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
        if message.content or not (blocks or message.tool_calls):
            blocks.append({"type": "text", "text": message.content or ""})
        for call in message.tool_calls:
            blocks.append({"type": "tool_use", "id": anthropic_id("toolu"), "name": call.function.name,
                           "input": tool_input(call.function.arguments)})  # fmt: skip
        return blocks

    async def _events(
        self, request: AnthropicMessagesRequest, chat: ChatCompletionRequest, run: ChatRun
    ) -> AsyncGenerator[str, None]:
        usage = {"input_tokens": len(run.prompt.token_ids), "output_tokens": 0}
        message = {"id": run.request_id, "type": "message", "role": "assistant", "model": run.model_name,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}  # fmt: skip
        blocks = _BlockEvents()
        try:
            yield sse_event("message_start", {"message": message})
            finish: Optional[ChatCompletionResponseStreamChoice] = None
            async for chunk in self.chat.stream_chunks(chat, run):
                if chunk.usage is not None and not chunk.choices:
                    usage["output_tokens"] = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    for event in blocks.feed(choice):
                        yield event
                    if choice.finish_reason is not None:
                        finish = choice
            for event in blocks.finish():
                yield event
            reason, sequence = stop_reason(
                request, finish and finish.finish_reason, finish and finish.stop_reason, blocks.called
            )
            yield sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                              "usage": {"output_tokens": usage["output_tokens"]}})  # fmt: skip
            yield sse_event("message_stop", {})
        except Exception as exc:
            status, text = _failure(exc)
            yield sse_event("error", {"error": error_body(status, text)["error"]})
        finally:
            await run.stream.aclose()


class _BlockEvents:
    """The content-block events of a stream's deltas: a block opens when a delta of another
    kind (thinking, text, a new tool call) comes, and the open one closes."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: Optional[str] = None
        self.called = False

    def feed(self, choice: ChatCompletionResponseStreamChoice) -> list[str]:
        delta = choice.delta
        events: list[str] = []
        if delta.reasoning:
            events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            events += self._tool_call(call)
        return events

    def _tool_call(self, call: DeltaToolCall) -> list[str]:
        events: list[str] = []
        function = call.function
        if call.id is not None:
            self.called = True
            block = {"type": "tool_use", "id": anthropic_id("toolu"), "name": function.name if function else "",
                     "input": {}}  # fmt: skip
            events += self._open(f"tool_use {call.index}", block)
        if function is not None and function.arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": function.arguments}))
        return events

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        if kind == self.kind:
            return []
        events = self.close()
        self.index += 1
        self.kind = kind
        return events + [sse_event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event("content_block_delta", {"index": self.index, "delta": delta})

    def finish(self) -> list[str]:
        """The events that end the content: the open block's stop (an empty text block when
        there was no content at all, as the non-streamed reply has)."""
        events = self._open("text", {"type": "text", "text": ""}) if self.index < 0 else []
        return events + self.close()

    def close(self) -> list[str]:
        """The stop event of the open block (none when none is open)."""
        if self.kind is None:
            return []
        self.kind = None
        return [sse_event("content_block_stop", {"index": self.index})]
