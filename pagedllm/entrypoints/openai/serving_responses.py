"""``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``: OpenAI's Responses API over the chat completions path
(``responses_conversion``: the request; ``OpenAIServingChat``: the engine run, tool calls
and reasoning).

A response's ``output`` is, in order: a ``reasoning`` item (with ``--reasoning-parser``;
its text as one ``reasoning_text`` part), a ``message`` item (one ``output_text`` part;
when there is text, or nothing else), one ``function_call`` item per call (``call_id``:
the chat call's id). ``status`` is "completed", or "incomplete" with
``incomplete_details.reason`` "max_output_tokens" when that limit cut the output.
``usage``: ``input_tokens`` (cached ones in ``input_tokens_details``), ``output_tokens``,
``total_tokens``, ``output_tokens_details.reasoning_tokens`` (the reasoning parser's
``count_reasoning_tokens``; 0 without one).

A stream is OpenAI's typed events (``event: TYPE`` + ``data: JSON``, each with its
``sequence_number`` from 0): ``response.created``, ``response.in_progress``; per item
``response.output_item.added``, then for text ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done`` (reasoning: the same with ``reasoning_text``), for a call
``response.function_call_arguments.delta`` ..., ``response.function_call_arguments.done``;
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when
cut off). A failure after the first event is one ``error`` event.

With ``store`` (the default) the response is kept (``ResponsesStore``; a stream's from its
first event, ``in_progress`` until it ends, "cancelled" when its client went away) for
``GET``, ``DELETE`` and ``previous_response_id``. Only background responses can be cancelled and pagedllm makes
none, so cancel answers a 400 for a known id (OpenAI's answer for a response that is not
a background one), a 404 for an unknown one.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncGenerator, Mapping, Optional, Union

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.entrypoints.openai.errors import OpenAIServingError, from_value_error
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatResponseMessage,
    DeltaToolCall,
    UsageInfo,
)
from pagedllm.entrypoints.openai.responses_conversion import chat_request, input_items, renamed_error
from pagedllm.entrypoints.openai.responses_protocol import NamedToolChoice, ResponsesRequest
from pagedllm.entrypoints.openai.responses_store import ResponsesStore, StoredResponse
from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import SAMPLING_FIELDS, sse, sse_error

logger = logging.getLogger(__name__)


def item_id(prefix: str) -> str:
    """An output item's or response's id: ``prefix``, "_" and 32 hex digits (OpenAI's form)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def not_found(response_id: str, param: Optional[str] = None) -> OpenAIServingError:
    """The 404 for a response id the server does not keep."""
    what = "Previous response" if param else "Response"
    return OpenAIServingError(f"{what} with id {response_id!r} not found.", 404, "invalid_request_error", param)


def responses_usage(usage: Optional[UsageInfo]) -> Optional[dict[str, Any]]:
    """The Responses ``usage`` of a chat usage."""
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": (usage.completion_tokens_details.reasoning_tokens
                                                        if usage.completion_tokens_details else 0)},
        "total_tokens": usage.total_tokens,
    }


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}  # fmt: skip


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def output_items(message: ChatResponseMessage, incomplete: bool) -> list[dict[str, Any]]:
    """The output items of a chat reply (module docstring); the last is "incomplete" when
    the output was cut off."""
    items = [reasoning_item(message.reasoning)] if message.reasoning else []
    if message.content or not (items or message.tool_calls):
        items.append(message_item(message.content or ""))
    for call in message.tool_calls:
        items.append(function_call_item(call.id, call.function.name, call.function.arguments))
    if incomplete:
        items[-1]["status"] = "incomplete"
    return items


class OpenAIServingResponses:
    """The Responses endpoints over ``chat`` (the server's ``OpenAIServingChat``), keeping
    stored responses in ``store``."""

    def __init__(self, chat: OpenAIServingChat, store: Optional[ResponsesStore] = None) -> None:
        self.chat = chat
        self.store = store or ResponsesStore()

    def _stored(self, response_id: str, param: Optional[str] = None) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id, param)
        return entry

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """The kept response object.

        Raises:
            OpenAIServingError: 404 for an id not kept.
        """
        return self._stored(response_id).response

    def delete(self, response_id: str) -> dict[str, Any]:
        """Drop a kept response; OpenAI's deletion object.

        Raises:
            OpenAIServingError: 404 for an id not kept.
        """
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def cancel(self, response_id: str) -> dict[str, Any]:
        """Always raises (module docstring): 404 for an unknown id, else 400."""
        self._stored(response_id)
        raise OpenAIServingError("Only responses created with background=true can be cancelled.", 400)

    async def create_response(
        self, request: ResponsesRequest, trace_headers: Optional[Mapping[str, str]] = None
    ) -> Union[dict[str, Any], AsyncGenerator[str, None]]:
        """The response object, or (``stream``) an async generator of its SSE events.
        ``trace_headers``: the caller's W3C trace context (see ``OpenAIServing.generate``).

        Raises:
            OpenAIServingError: 400 for bad input, 404 for an unknown model or
                ``previous_response_id``.
            EngineDeadError: the engine died (a 500).
        """
        conversation: list[dict[str, Any]] = []
        if request.previous_response_id:
            conversation = self._stored(request.previous_response_id, "previous_response_id").conversation()
        conversation += input_items(request)
        chat = chat_request(request, conversation)
        try:
            run = self.chat.start(chat, item_id("resp"), trace_headers)
            if request.stream:
                run.stream = await self.chat.start_stream(run.stream)
            else:
                (final,) = await self.chat.collect_final(run.stream, 1)
        except OpenAIServingError as exc:
            raise renamed_error(exc) from None
        response = _ResponseObject(request, run, conversation)
        if request.stream:
            return self._events(chat, run, response)
        completion = self.chat.response(chat, run, final)
        message, finish = completion.choices[0].message, completion.choices[0].finish_reason
        response.finish(output_items(message, finish == "length"), finish, completion.usage)
        self._keep(request, response)
        return response.body

    def _keep(self, request: ResponsesRequest, response: "_ResponseObject") -> None:
        if request.store:
            self.store.put(StoredResponse(response.body, response.input_items))

    async def _events(
        self, chat: ChatCompletionRequest, run: ChatRun, response: "_ResponseObject"
    ) -> AsyncGenerator[str, None]:
        sequence = _Sequence()
        items = _ItemEvents()
        try:
            self._keep(response.request, response)
            yield sequence.event("response.created", {"response": response.body})
            yield sequence.event("response.in_progress", {"response": response.body})
            finish, usage = None, None
            async for chunk in self.chat.stream_chunks(chat, run):
                if chunk.usage is not None and not chunk.choices:
                    usage = chunk.usage
                for choice in chunk.choices:
                    for name, data in items.feed(choice):
                        yield sequence.event(name, data)
                    finish = choice.finish_reason or finish
            for name, data in items.finish(incomplete=finish == "length"):
                yield sequence.event(name, data)
            response.finish(items.output, finish, usage)
            self._keep(response.request, response)
            final = "response.incomplete" if response.body["status"] == "incomplete" else "response.completed"
            yield sequence.event(final, {"response": response.body})
        except Exception as exc:
            if not isinstance(exc, (ValueError, OpenAIServingError, EngineDeadError)):
                logger.exception("Stream %s failed", run.request_id)
            response.fail(exc)
            yield sequence.error(exc)
        finally:
            if response.body["status"] == "in_progress":  # the client went away: the engine request is aborted
                response.body["status"] = "cancelled"
            await run.stream.aclose()


class _ResponseObject:
    """The response object of a request (``body``, a JSON-ready dict) as it goes from
    ``in_progress`` to its end, and the conversation that led to it (``input_items``)."""

    def __init__(self, request: ResponsesRequest, run: ChatRun, input_items: list[dict[str, Any]]) -> None:
        self.request = request
        self.input_items = input_items
        choice = request.tool_choice
        text_format = request.text.format.model_dump(by_alias=True, exclude_none=True)
        if text_format["type"] == "json_schema":
            text_format.setdefault("name", "response")
        self.body: dict[str, Any] = {
            "id": run.request_id, "object": "response", "created_at": int(time.time()), "model": run.model_name,
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": request.reasoning.model_dump() if request.reasoning else None, "store": request.store,
            "temperature": request.temperature, "top_p": request.top_p, "text": {"format": text_format},
            "tool_choice": choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
            "tools": [tool.model_dump() for tool in request.tools], "truncation": request.truncation,
            "usage": None, "user": request.user, "background": False,
        }  # fmt: skip

    def finish(self, output: list[dict[str, Any]], finish_reason: Optional[str], usage: Optional[UsageInfo]) -> None:
        """The end: ``output``, the status of ``finish_reason`` and the usage."""
        incomplete = finish_reason == "length"
        self.body.update(
            output=output, usage=responses_usage(usage), status="incomplete" if incomplete else "completed",
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            completed_at=None if incomplete else int(time.time()),
        )  # fmt: skip

    def fail(self, exc: BaseException) -> None:
        self.body.update(status="failed", error={"code": "server_error", "message": str(exc)})


class _Sequence:
    """Numbers a stream's events (``sequence_number`` from 0) and writes them as SSE."""

    def __init__(self) -> None:
        self.number = 0

    def event(self, name: str, data: dict[str, Any]) -> str:
        body = {"type": name, "sequence_number": self.number, **data}
        self.number += 1
        return sse(json.dumps(body, ensure_ascii=False), event=name)

    def error(self, exc: BaseException) -> str:
        """The ``error`` event of a failure (the message, type and param of OpenAI's error JSON)."""
        if isinstance(exc, ValueError):
            exc = from_value_error(exc, SAMPLING_FIELDS)
        error = json.loads(sse_error(exc).removeprefix("data: "))["error"]
        return self.event("error", {"code": error["code"], "message": error["message"], "param": error["param"]})


class _ItemEvents:
    """The output-item events of a stream's deltas: an item opens when a delta of another
    kind (reasoning, text, a new call) comes, and the open one closes. ``output`` holds
    the finished items."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self.item: Optional[dict[str, Any]] = None
        self.text = ""

    def feed(self, choice: ChatCompletionResponseStreamChoice) -> list[tuple[str, dict[str, Any]]]:
        delta = choice.delta
        events: list[tuple[str, dict[str, Any]]] = []
        if delta.reasoning:
            events += self._open("reasoning", lambda: reasoning_item("", "in_progress"))
            events.append(self._text_delta("response.reasoning_text.delta", delta.reasoning))
        if delta.content:
            events += self._open("message", lambda: message_item("", "in_progress"))
            events.append(self._text_delta("response.output_text.delta", delta.content, logprobs=[]))
        for call in delta.tool_calls or []:
            events += self._tool_call(call)
        return events

    def _tool_call(self, call: DeltaToolCall) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        function = call.function
        if call.id is not None:
            events += self.close()
            name = function.name if function and function.name else ""
            events += self._open("function_call", lambda: function_call_item(call.id or "", name, "", "in_progress"))
        if function is not None and function.arguments:
            self.text += function.arguments
            events.append(("response.function_call_arguments.delta", {**self._where(), "delta": function.arguments}))
        return events

    def _where(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def _text_delta(self, name: str, text: str, **extra: Any) -> tuple[str, dict[str, Any]]:
        self.text += text
        return name, {**self._where(), "content_index": 0, "delta": text, **extra}

    def _open(self, kind: str, make_item: Any) -> list[tuple[str, dict[str, Any]]]:
        if self.item is not None and self.item["type"] == kind:
            return []
        events = self.close()
        item = make_item()
        content = item.pop("content", None)
        self.item, self.text = item, ""
        events.append(("response.output_item.added", {"output_index": len(self.output), "item": dict(item, **(
            {"content": []} if content is not None else {}))}))  # fmt: skip
        if content is not None:
            events.append(("response.content_part.added", {**self._where(), "content_index": 0, "part": content[0]}))
        return events

    def finish(self, incomplete: bool) -> list[tuple[str, dict[str, Any]]]:
        """The events that end the output: the open item's end, "incomplete" when the
        output was cut off (an empty message when there was no output at all, as the
        non-streamed response has)."""
        empty = self.item is None and not self.output
        events = self._open("message", lambda: message_item("", "in_progress")) if empty else []
        return events + self.close(incomplete)

    def close(self, incomplete: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """The events that end the open item (none when none is open)."""
        if self.item is None:
            return []
        item, where, status = self.item, self._where(), "incomplete" if incomplete else "completed"
        events: list[tuple[str, dict[str, Any]]] = []
        if item["type"] == "function_call":
            item.update(arguments=self.text, status=status)
            done = {**where, "name": item["name"], "arguments": self.text}
            events.append(("response.function_call_arguments.done", done))
        else:
            part = reasoning_item(self.text)["content"][0] if item["type"] == "reasoning" else text_part(self.text)
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append((f"response.{kind}.done", {**where, "content_index": 0, "text": self.text, **extra}))
            events.append(("response.content_part.done", {**where, "content_index": 0, "part": part}))
            item.update(content=[part], status=status)
        events.append(("response.output_item.done", {"output_index": where["output_index"], "item": item}))
        self.output.append(item)
        self.item, self.text = None, ""
        return events
