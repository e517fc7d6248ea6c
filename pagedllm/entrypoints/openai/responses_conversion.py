"""Responses API requests -> the chat completions request the engine runs
(``ChatCompletionRequest``), so both APIs share one path: chat template, sampling,
structured outputs, tool calling and reasoning.

- ``instructions`` becomes the first message (``system``); those of an earlier response
  in a ``previous_response_id`` chain are not carried over (OpenAI's rule).
- The conversation (earlier input and output items, then ``input``) becomes messages:
  a message item keeps its role (text parts joined as the chat path joins them); a
  ``function_call`` item becomes a ``tool_calls`` entry of the assistant message before it
  (or of a new, empty one); a ``function_call_output`` item a ``tool`` message
  (``tool_call_id``: its ``call_id``); ``reasoning`` items are not rendered.
- ``tools`` become chat functions; ``tool_choice`` {"type": "function", "name"} the named
  function; ``text.format`` becomes ``response_format``; ``max_output_tokens`` is
  ``max_completion_tokens``; a stream asks for the usage chunk.
Source: OpenAI's Responses API reference; vLLM's ``OpenAIServingResponses`` maps the same way.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIServingError, bad_request, validation_error_message
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.responses_protocol import InputItem, NamedToolChoice, ResponsesRequest, TextPart

#: Chat completions request fields -> the Responses field a user set them with.
RESPONSES_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
}


def responses_param(param: Optional[str]) -> Optional[str]:
    """The Responses field of a chat completions field an error names."""
    return RESPONSES_PARAMS.get(param, param) if param else param


def renamed_error(exc: OpenAIServingError) -> OpenAIServingError:
    """``exc`` naming the Responses field instead of the chat field (same object)."""
    exc.param = responses_param(exc.param)
    return exc


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as item dicts (a string is one user message)."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    return [item.model_dump(exclude_none=True) for item in request.input]


def chat_request(request: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completions request of a Responses request whose whole conversation (earlier
    turns, then ``input``) is ``conversation`` (item dicts).

    Raises:
        OpenAIServingError: 400 for what the chat request refuses, naming the Responses field.
    """
    messages = chat_messages(request.instructions, conversation)
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": request.text.format.response_format(),
        "user": request.user,
        "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None,
    }
    if request.tools:
        body["tools"] = [tool.chat_tool() for tool in request.tools]
        choice = request.tool_choice
        named = isinstance(choice, NamedToolChoice)
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} if named else choice
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param = validation_error_message(list(exc.errors()))
        raise bad_request(message, param=responses_param(param)) from None


def chat_messages(instructions: Optional[str], conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and a conversation (module docstring).

    Raises:
        OpenAIServingError: 400 for an item that does not validate (``param`` "input").
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for data in conversation:
        try:
            item = InputItem.model_validate(data)
        except ValidationError as exc:
            raise bad_request(validation_error_message(list(exc.errors()))[0], param="input") from None
        if item.type == "message":
            messages.append({"role": item.role, "content": _text(item.content)})
        elif item.type == "function_call":
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _text(content: Any) -> Any:
    """A message's content for the chat path: a string as is, parts as chat text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    return [{"type": "text", "text": part.text} for part in content if isinstance(part, TextPart)]
