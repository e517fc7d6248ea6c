"""Request and response bodies of Anthropic's Messages API (``POST /v1/messages``,
``POST /v1/messages/count_tokens``), pydantic v2. Field names, types and defaults follow
Anthropic's API reference; ``chat_template_kwargs`` is vLLM's extra.

Content blocks in requests: ``text``, ``tool_use`` (an assistant's call), ``tool_result``
(a user's answer to one), ``thinking`` / ``redacted_thinking`` (an assistant's earlier
reasoning, accepted and not rendered); any other type (images, documents ...) is a 400
naming it. Unknown top-level fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The content block types a request may carry.
REQUEST_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class AnthropicBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AnthropicContentBlock(AnthropicBaseModel):
    """One request content block (the fields its ``type`` needs; see the module docstring)."""

    type: str
    text: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    is_error: Optional[bool] = None
    thinking: Optional[str] = None
    signature: Optional[str] = None

    @model_validator(mode="after")
    def _check_fields(self) -> "AnthropicContentBlock":
        if self.type not in REQUEST_BLOCK_TYPES:
            supported = ", ".join(repr(kind) for kind in REQUEST_BLOCK_TYPES)
            raise ValueError(f"content blocks of type {self.type!r} are not supported; supported: {supported}.")
        needed = {"text": ("text",), "tool_use": ("id", "name"), "tool_result": ("tool_use_id",)}
        missing = [name for name in needed.get(self.type, ()) if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type!r} block needs {', '.join(repr(name) for name in missing)}.")
        return self


class AnthropicMessage(AnthropicBaseModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[AnthropicContentBlock]]


class AnthropicTool(AnthropicBaseModel):
    """A tool the model may use: its ``input_schema`` is a JSON schema."""

    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(AnthropicBaseModel):
    """``auto`` (the model decides), ``any`` (some tool), ``tool`` (the one ``name``d), ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None

    @model_validator(mode="after")
    def _check_name(self) -> "AnthropicToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice of type "tool" needs the tool\'s "name".')
        return self


SystemPrompt = Union[str, list[AnthropicContentBlock]]


class AnthropicCountTokensRequest(AnthropicBaseModel):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[SystemPrompt] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """``POST /v1/messages``. ``max_tokens`` is required (Anthropic's rule)."""

    max_tokens: int
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    metadata: Optional[dict[str, Any]] = None


class AnthropicUsage(AnthropicBaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicMessagesResponse(AnthropicBaseModel):
    """A reply: ``content`` blocks in order (``thinking``, ``text``, ``tool_use``)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Optional[str] = None
    stop_sequence: Optional[str] = None
    usage: AnthropicUsage


class AnthropicCountTokensResponse(AnthropicBaseModel):
    input_tokens: int


class AnthropicError(AnthropicBaseModel):
    type: str
    message: str


class AnthropicErrorResponse(AnthropicBaseModel):
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""

    type: Literal["error"] = "error"
    error: AnthropicError
