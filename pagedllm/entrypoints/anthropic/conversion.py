"""Anthropic Messages requests -> the chat completions request the engine runs
(``ChatCompletionRequest``), so both APIs share one path: chat template, sampling, tool
calling and reasoning.

- ``system`` (a string, or text blocks joined with newlines) becomes the first message.
- A message's text blocks become its content parts; an assistant's ``tool_use`` blocks its
  ``tool_calls`` (``input`` as JSON arguments, the block's id as the call's id); a user's
  ``tool_result`` blocks become ``tool`` messages (``tool_call_id``: the block's
  ``tool_use_id``), before that message's own text. ``thinking`` blocks are not rendered.
- ``tools`` become functions (``input_schema`` -> ``parameters``); ``tool_choice`` ``auto`` /
  ``any`` / ``tool`` / ``none`` -> "auto" / "required" / the named function / "none", and
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls`` false.
- ``max_tokens``, ``stop_sequences`` (-> ``stop``), ``temperature``, ``top_p``, ``top_k`` as
  given; a stream asks for the usage chunk (``message_delta`` reports it).
Source: Anthropic's Messages API reference; vLLM's ``AnthropicServingMessages`` maps the same way.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import ValidationError

from pagedllm.entrypoints.anthropic.protocol import (
    AnthropicContentBlock,
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    AnthropicToolChoice,
    SystemPrompt,
)
from pagedllm.entrypoints.openai.errors import bad_request, validation_error_message
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest


def chat_request(request: Union[AnthropicMessagesRequest, AnthropicCountTokensRequest]) -> ChatCompletionRequest:
    """The chat completions request of a Messages (or count_tokens) request.

    Raises:
        OpenAIServingError: 400 for what the chat request refuses (a tool_choice naming no
            tool, a tool_result block that is not text ...).
    """
    body: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request),
        "chat_template_kwargs": request.chat_template_kwargs,
    }
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                              "parameters": tool.input_schema}}
            for tool in request.tools
        ]  # fmt: skip
    if request.tool_choice is not None:
        body.update(_tool_choice(request.tool_choice))
    if isinstance(request, AnthropicMessagesRequest):
        body.update(
            max_tokens=request.max_tokens, stop=request.stop_sequences, temperature=request.temperature,
            top_p=request.top_p, top_k=request.top_k, stream=request.stream,
            stream_options={"include_usage": True} if request.stream else None,
        )  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param = validation_error_message(list(exc.errors()))
        raise bad_request(message, param=param) from None


def _tool_choice(choice: AnthropicToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.type == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _system_text(system: Optional[SystemPrompt]) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if any(block.type != "text" for block in system):
        raise bad_request("system blocks must be 'text' blocks.", param="system")
    return "\n".join(block.text or "" for block in system)


def chat_messages(request: Union[AnthropicMessagesRequest, AnthropicCountTokensRequest]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``system`` and ``messages`` (module docstring)."""
    messages: list[dict[str, Any]] = []
    system_text = _system_text(request.system)
    if system_text:
        messages.append({"role": "system", "content": system_text})
    for message in request.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts = [{"type": "text", "text": block.text} for block in message.content if block.type == "text"]
        calls = [_tool_call(block) for block in message.content if block.type == "tool_use"]
        for block in message.content:
            if block.type == "tool_result":
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)})
        if calls:
            messages.append({"role": message.role, "content": texts or "", "tool_calls": calls})
        elif texts or not any(block.type == "tool_result" for block in message.content):
            messages.append({"role": message.role, "content": texts})
    return messages


def _tool_call(block: AnthropicContentBlock) -> dict[str, Any]:
    arguments = json.dumps(block.input or {}, ensure_ascii=False)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


def _result_text(block: AnthropicContentBlock) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    texts = []
    for part in block.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                f"tool_result content blocks of type {part.get('type')!r} are not supported; only 'text' ones are.",
                param="messages",
            )
        texts.append(part["text"])
    return "\n".join(texts)
