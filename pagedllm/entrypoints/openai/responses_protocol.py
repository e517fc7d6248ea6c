"""Request bodies of OpenAI's Responses API (``POST /v1/responses``), pydantic v2. Field
names, types and defaults follow OpenAI's API reference (the ``openai`` SDK's
``responses.create`` parameters).

``input`` is a string (one user message) or a list of items: messages (roles ``user``,
``system``, ``developer``, ``assistant``; content a string or ``input_text`` /
``output_text`` parts), ``function_call`` items (a call the model made) and
``function_call_output`` items (its result); ``reasoning`` items (earlier reasoning sent
back) are accepted and not rendered. Any other item or part type is a 400 naming it.

Fields pagedllm does not act on (``UNSUPPORTED``: ``background``, ``conversation``,
``prompt``, ...) are a 400 naming the field when set; so is a tool that is not a
``function`` tool (built-in tools such as ``web_search``). Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationInfo, create_model, field_validator, model_validator

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, OpenAIRequest, refuse_if_set

#: Fields of OpenAI's Responses API that pagedllm does not act on -> the feature they ask for.
UNSUPPORTED = {
    "background": "background responses",
    "conversation": "stored conversations (use previous_response_id)",
    "prompt": "stored prompt templates",
    "max_tool_calls": "built-in tool call limits",
    "top_logprobs": "logprobs in responses",
    "prompt_cache_key": "prompt cache keys",
}

#: The content part types of an input message.
TEXT_PART_TYPES = ("input_text", "output_text")
#: The roles of an input message.
MESSAGE_ROLES = ("user", "system", "developer", "assistant")


class TextPart(OpenAIBaseModel):
    """A message's text part (``input_text``, or ``output_text`` of an earlier reply)."""

    type: str
    text: Optional[str] = None

    @model_validator(mode="after")
    def _check_type(self) -> "TextPart":
        if self.type not in TEXT_PART_TYPES:
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'input_text' and "
                             "'output_text' parts are.")  # fmt: skip
        if self.text is None:
            raise ValueError(f"an {self.type!r} part needs a 'text' field.")
        return self


class InputItem(OpenAIBaseModel):
    """One item of ``input`` (the fields its ``type`` needs; see the module docstring).

    A message may leave ``type`` out (OpenAI's "easy input message")."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Optional[str] = None
    content: Optional[Union[str, list[TextPart]]] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Optional[Union[str, list[TextPart]]] = None

    @model_validator(mode="before")
    @classmethod
    def _drop_reasoning_content(cls, data: Any) -> Any:
        """A ``reasoning`` item's parts are not rendered (nor checked)."""
        if isinstance(data, dict) and data.get("type") == "reasoning":
            return {"type": "reasoning"}
        return data

    @model_validator(mode="after")
    def _check_fields(self) -> "InputItem":
        if self.type == "message" and self.role not in MESSAGE_ROLES:
            raise ValueError(f"a message needs a 'role', one of {', '.join(map(repr, MESSAGE_ROLES))}.")
        needed = {"message": ("content",), "function_call": ("call_id", "name", "arguments"),
                  "function_call_output": ("call_id", "output")}  # fmt: skip
        missing = [name for name in needed.get(self.type, ()) if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type!r} item needs {', '.join(repr(name) for name in missing)}.")
        return self


class FunctionTool(OpenAIBaseModel):
    """A function the model may call (the Responses shape: ``name`` and ``parameters`` at
    the top level)."""

    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _check_type(self) -> "FunctionTool":
        if self.type != "function":
            raise ValueError(f"built-in tools ({self.type!r}) are not supported; only 'function' tools are.")
        if not self.name:
            raise ValueError("a 'function' tool needs a 'name'.")
        return self

    def chat_tool(self) -> dict[str, Any]:
        """The chat completions ``tools`` entry of this function."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


class NamedToolChoice(OpenAIBaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    """``text.format``: ``text`` (nothing), ``json_object``, or ``json_schema`` (``name``,
    ``schema``, ``strict``, ``description`` beside ``type``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _check_schema(self) -> "TextFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a 'json_schema' format needs its 'schema'.")
        return self

    def response_format(self) -> dict[str, Any]:
        """The chat completions ``response_format`` of this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name or "response", "description": self.description, "schema": self.json_schema,
                  "strict": self.strict}  # fmt: skip
        return {"type": "json_schema", "json_schema": schema}


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningConfig(OpenAIBaseModel):
    """``reasoning``: accepted and echoed; the reasoning comes from ``--reasoning-parser``."""

    effort: Optional[str] = None
    summary: Optional[str] = None


#: The ``UNSUPPORTED`` fields, any value (``ResponsesRequest`` refuses them when set).
_UnsupportedFields = create_model(
    "_UnsupportedFields", __base__=OpenAIRequest, **{name: (Any, None) for name in UNSUPPORTED}
)  # type: ignore[call-overload]


class ResponsesRequest(_UnsupportedFields):  # type: ignore[misc,valid-type]
    """``POST /v1/responses``. ``max_output_tokens`` defaults as chat completions'
    ``max_completion_tokens``; ``tool_choice`` defaults to "auto" (with ``tools``)."""

    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice] = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: Optional[ReasoningConfig] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Literal["auto", "disabled"] = "disabled"

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        field = info.field_name or ""
        return refuse_if_set(field, value, UNSUPPORTED[field])

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Union[str, list[InputItem]]) -> Union[str, list[InputItem]]:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be an empty list.")
        return value

    @model_validator(mode="after")
    def _check_tool_choice(self) -> "ResponsesRequest":
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.name not in {tool.name for tool in self.tools}:
                raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not one of the tools.")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError('tool_choice "required" needs tools.')
        return self
