"""Request and response bodies of the OpenAI HTTP API (pydantic v2), with vLLM's extras.

Field names, types and defaults follow OpenAI's API reference for ``/v1/completions`` and
``/v1/chat/completions``; the extra sampling fields (``top_k``, ``min_p``, ``ignore_eos``
...) and ``/tokenize`` / ``/detokenize`` follow vLLM's OpenAI server.

- Sampling fields carry no range rules here: ``SamplingParams`` holds them, for offline
  and online alike (its ``ValueError`` becomes a 400 naming the field).
- A sampling field that is absent or null takes the model's default (its
  generation_config.json), else vLLM's, as vLLM's server does.
- Fields vLLM acts on but pagedllm does not yet (``NOT_SUPPORTED_YET``) get a 400 naming
  the field when they ask for something; truly unknown fields are ignored, as OpenAI
  does, and named in one WARNING log line ("The following fields were present in the
  request but ignored: {...}", vLLM's words).

A body that does not validate becomes a 400 ``invalid_request_error`` (see ``errors``).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from pagedllm.entrypoints.openai.structured_outputs import LEGACY_FIELDS, ResponseFormat, structured_outputs_params
from pagedllm.sampling_params import (
    DEFAULT_MAX_TOKENS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    check_best_of,
    check_logprobs,
)

logger = logging.getLogger(__name__)

#: Request fields of vLLM's server that pagedllm does not act on yet -> the feature they
#: ask for. A request that sets one to anything but a neutral value (absent, null, false,
#: empty, and the values in ``_NEUTRAL_VALUES``) gets a 400 naming the field.
NOT_SUPPORTED_YET = {
    "use_beam_search": "beam search",
    "length_penalty": "beam search",
    "logits_processors": "custom logits processors",
    "vllm_xargs": "custom logits processors",
    "prompt_embeds": "prompt embeddings",
    "functions": "legacy function calling (use tools)",
    "function_call": "legacy function calling (use tool_choice)",
}

#: Values of ``NOT_SUPPORTED_YET`` fields that ask for nothing, besides null / false / empty.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "length_penalty": (1.0,),
    "function_call": ("none", "auto"),
}


def refuse_if_set(field: str, value: Any, feature: str) -> Any:
    """``value``, when it asks for nothing (null, false, empty, or neutral for ``field``).

    Raises:
        ValueError: "``field`` is not supported yet (pagedllm has no ``feature`` yet) ...".
    """
    if value is None or value is False or value == [] or value == {} or value == "":
        return value
    if value in _NEUTRAL_VALUES.get(field, ()):
        return value
    raise ValueError(f"{field} is not supported yet (pagedllm has no {feature} yet); send the request without it.")


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def unknown_fields(model: type[BaseModel], data: Mapping[Any, Any]) -> list[str]:
    """The keys of ``data`` that are neither a field name nor an alias of ``model``, sorted."""
    known = set(model.model_fields)
    known.update(f.alias for f in model.model_fields.values() if f.alias)
    return sorted(str(key) for key in data if key not in known)


class OpenAIRequest(OpenAIBaseModel):
    """A request body: unknown top-level fields are dropped (OpenAI's behaviour) and named
    in one WARNING line per request that validates (vLLM's message)."""

    @model_validator(mode="wrap")
    @classmethod
    def _log_unknown_fields(cls, data: Any, handler: Any) -> Any:
        request = handler(data)
        if isinstance(data, Mapping):
            unknown = unknown_fields(cls, data)
            if unknown:
                listed = ", ".join(repr(name) for name in unknown)
                logger.warning("The following fields were present in the request but ignored: {%s}", listed)
        return request

    @field_validator(*NOT_SUPPORTED_YET, check_fields=False)
    @classmethod
    def _refuse_not_yet(cls, value: Any, info: ValidationInfo) -> Any:
        field = info.field_name or ""
        return refuse_if_set(field, value, NOT_SUPPORTED_YET[field])


# --------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Union[int, str, None] = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- common


class StreamOptions(OpenAIBaseModel):
    """``include_usage``: one last chunk with ``choices: []`` and the usage of the whole
    request. ``continuous_usage_stats`` (vLLM): every chunk carries the usage so far."""

    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    """Token counts: the prompt counted once per prompt, completions summed over choices;
    ``completion_tokens_details.reasoning_tokens`` with a reasoning parser (else absent)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    # NOTE: left out of the JSON when None (no reasoning parser), not sent as null.
    completion_tokens_details: Optional[CompletionTokensDetails] = Field(default=None, exclude_if=lambda v: v is None)


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               reasoning_tokens: Optional[int] = None) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        completion_tokens_details=None if reasoning_tokens is None else CompletionTokensDetails(
            reasoning_tokens=reasoning_tokens),
    )


class SamplingRequest(OpenAIRequest):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras).

    The sampling fields that are None here (absent or null) take the model's default
    (``to_sampling_params``).
    """

    model: Optional[str] = None
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    n: int = 1
    presence_penalty: Optional[float] = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[int] = None
    return_tokens_as_token_ids: Optional[bool] = None
    cache_salt: Optional[str] = None
    # vLLM's: the request's place under --scheduling-policy priority (lower runs first).
    priority: int = 0
    truncate_prompt_tokens: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    # Structured outputs (see ``structured_outputs``): OpenAI's, vLLM's, vLLM's older ones
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    _structured_outputs: Optional[StructuredOutputsParams] = PrivateAttr(default=None)
    # vLLM fields pagedllm does not act on yet (NOT_SUPPORTED_YET: a 400 when set)
    use_beam_search: Any = None
    length_penalty: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    # vLLM's: a prefill / decode split (``pagedllm.sampling_params.check_kv_transfer_params``);
    # the response's ``kv_transfer_params`` carries what the decode instance's request needs.
    kv_transfer_params: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check_structured_outputs(self) -> "SamplingRequest":
        self._structured_outputs = structured_outputs_params(
            self.response_format, self.structured_outputs,
            {name: getattr(self, name) for name in (*LEGACY_FIELDS, "guided_decoding_backend")},
        )
        return self

    @model_validator(mode="after")
    def _check_stream_options(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        return self

    @field_validator("n", mode="before")
    @classmethod
    def _default_n(cls, value: Any) -> Any:
        return 1 if value is None else value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def requested_max_tokens(self) -> Optional[int]:
        """The ``max_tokens`` the request sets (None: absent or null)."""
        raise NotImplementedError

    @property
    def max_tokens_param(self) -> str:
        """The request field that sets ``max_tokens`` (named in error messages)."""
        return "max_tokens"

    @property
    def default_max_tokens(self) -> Optional[int]:
        """What ``max_tokens`` is when the request does not set it (None: the model's
        default, else the rest of the context; see ``Processor.resolve_max_tokens``)."""
        return None

    def to_sampling_params(
        self,
        max_tokens: int,
        logprobs: Optional[int],
        prompt_logprobs: Optional[int],
        defaults: Optional[Mapping[str, Any]] = None,
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` (DELTA outputs when streaming, else FINAL_ONLY).

        A sampling field that is None (absent or null) takes ``defaults`` (the model's,
        ``Processor.default_sampling_params``), else ``SamplingParams``' default: vLLM's
        ``to_sampling_params`` rule.

        Raises:
            ValueError: a field out of range (the message starts with the field name) or
                a ``logit_bias`` key that is not a token id.
        """
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(token_id): bias for token_id, bias in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers, as strings).") from None
        return SamplingParams.from_optional(
            defaults,
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=logit_bias,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self._structured_outputs,
            extra_args={"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None,
        )


#: vLLM's form of one position's prompt logprobs: token id -> logprob, rank, text.
class LogprobInfo(OpenAIBaseModel):
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


PromptLogprobsJSON = list[Optional[dict[int, LogprobInfo]]]


# --------------------------------------------------------------------------- completions


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``prompt`` is a string, a list of strings, a list of token
    ids, or a list of token-id lists. ``max_tokens`` absent means OpenAI's default, 16
    (``DEFAULT_MAX_TOKENS``, cut to the room the prompt leaves); null means the model's
    default, else the rest of the context (vLLM: ``max_tokens: int | None = 16``, and None
    falls back to the rest of the context in ``get_max_tokens``). ``echo`` with
    ``max_tokens: 0`` returns the prompt alone, with its logprobs (``echo_only``)."""

    prompt: Union[list[int], list[list[int]], str, list[str]]
    max_tokens: Optional[int] = DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    # vLLM extras
    add_special_tokens: bool = True
    prompt_embeds: Any = None

    @field_validator("suffix")
    @classmethod
    def _refuse_suffix(cls, value: Optional[str]) -> Optional[str]:
        return refuse_if_set("suffix", value, "insertion (suffix)")

    @model_validator(mode="after")
    def _check_best_of(self) -> "CompletionRequest":
        check_best_of(self.best_of, self.n)
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt is scored, nothing is generated (OpenAI's
        legacy completions, used to score prompts; vLLM runs one step and drops its token,
        as here: ``requested_max_tokens`` is then 1)."""
        return self.echo and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> Optional[int]:
        if self.echo_only:
            return 1
        return self.max_tokens if "max_tokens" in self.model_fields_set else None

    @property
    def default_max_tokens(self) -> Optional[int]:
        return None if "max_tokens" in self.model_fields_set else DEFAULT_MAX_TOKENS


class CompletionLogProbs(OpenAIBaseModel):
    """OpenAI's completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: Optional[PromptLogprobsJSON] = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None  # vLLM's: a prefill instance's answer


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: Optional[PromptLogprobsJSON] = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# --------------------------------------------------------------------------- tool calling


class FunctionDefinition(OpenAIBaseModel):
    """A function the model may call: its ``parameters`` are a JSON schema (OpenAI's)."""

    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    """``tool_choice`` naming one function: the model must call it."""

    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


ToolChoice = Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoiceParam]


class FunctionCall(OpenAIBaseModel):
    """A call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    """One tool call of a reply; ``id`` is unique (``call_`` and 24 hex digits, OpenAI's form)."""

    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DropNoneModel(OpenAIBaseModel):
    """A streamed piece: fields that are None are left out of the JSON."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(DropNoneModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(DropNoneModel):
    """A streamed piece of call ``index``: the first carries ``id``, ``type`` and the
    function's name; the next ones carry fragments of its arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


def check_tool_choice(data: Any) -> Any:
    """vLLM's rules on ``tools`` / ``tool_choice`` (``ChatCompletionRequest.check_tool_usage``):
    ``tool_choice`` defaults to "auto" when ``tools`` are given (else "none"); any other
    choice than "none" needs ``tools``; a named choice must name one of them; "required"
    with an empty tool list means "none" (OpenAI's behaviour).

    Raises:
        ValueError: the rules above (a 400).
    """
    if not isinstance(data, dict):
        return data
    if data.get("tool_choice") is None:
        data = {**data, "tool_choice": "auto" if data.get("tools") else "none"}
    choice, tools = data["tool_choice"], data.get("tools")
    if choice == "none":
        return data
    if tools is None:
        raise ValueError("When using `tool_choice`, `tools` must be set.")
    if choice == "required" and tools == []:
        return {**data, "tool_choice": "none", "tools": None}
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(
                'tool_choice must name a function: {"type": "function", "function": {"name": "my_function"}}.'
            )
        functions = [tool.get("function") for tool in tools if isinstance(tool, dict)]
        names = [function.get("name") for function in functions if isinstance(function, dict)]
        if name not in names:
            raise ValueError(f"The tool specified in `tool_choice` ({name!r}) does not match any of the specified `tools`.")
    elif choice not in ("auto", "required"):
        raise ValueError(
            f'Invalid value for `tool_choice`: {choice!r}! Only named tools, "none", "auto" or "required" are supported.'
        )
    return data


def tool_call_json_schema(tools: list[ChatCompletionToolsParam], tool_choice: ToolChoice,
                          parallel_tool_calls: Optional[bool] = True) -> Optional[dict[str, Any]]:
    """The JSON schema that enforces ``tool_choice`` (None for "none" and "auto").

    As vLLM (``ChatCompletionRequest._get_json_schema_from_tool``): a named function's
    ``parameters``; for "required" an array (``minItems`` 1; ``maxItems`` 1 when
    ``parallel_tool_calls`` is false, so the grammar ends after one call) of objects
    ``{"name", "parameters"}``, each matching one tool (``anyOf``, the name as a one-value
    ``enum``, a tool without parameters taking ``{}``), the tools' ``$defs`` gathered at
    the top.

    Raises:
        ValueError: two tools define the same ``$defs`` name differently.
    """
    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        function = next(tool.function for tool in tools if tool.function.name == tool_choice.function.name)
        return function.parameters or {"type": "object", "properties": {}}
    if tool_choice != "required":
        return None
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = dict(tool.function.parameters or {"type": "object", "properties": {}})
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"Tool definition {name!r} has multiple schemas, which is not supported.")
        variants.append(
            {
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# --------------------------------------------------------------------------- chat


#: The message roles of OpenAI's chat API (``developer`` is its newer name for ``system``).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ImageURL(OpenAIBaseModel):
    """An ``image_url`` part's image: ``url`` (``data:``, ``file://`` or ``http(s)://``);
    ``detail`` is accepted (OpenAI's values) and changes nothing."""

    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None


class VideoURL(OpenAIBaseModel):
    """A ``video_url`` part's video (vLLM's): ``url`` (``data:video/...``, ``file://`` or ``http(s)://``)."""

    url: str


class ChatContentPart(OpenAIBaseModel):
    """One part of a message's content: ``{"type": "text", "text": ...}``, or for an image-text
    model ``{"type": "image_url", "image_url": {"url": ...}}`` / ``{"type": "video_url",
    "video_url": {"url": ...}}`` (``chat_utils.conversation_images``)."""

    type: str
    text: Optional[str] = None
    image_url: Optional[ImageURL] = None
    video_url: Optional[VideoURL] = None

    @model_validator(mode="after")
    def _check_text(self) -> "ChatContentPart":
        if self.type in ("image_url", "video_url"):
            if getattr(self, self.type) is None:
                raise ValueError(f"a {self.type!r} content part needs a {self.type!r} field.")
            return self
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text', 'image_url' and "
                             "'video_url' parts are.")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' field.")
        return self


class ChatMessage(OpenAIBaseModel):
    """One message. Extra fields (``tool_calls`` of an assistant message, ``tool_call_id``
    of a ``tool`` message ...) are kept and passed to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, list[ChatContentPart]]] = None
    name: Optional[str] = None

    @field_validator("role")
    @classmethod
    def _check_role(cls, value: str) -> str:
        if value not in CHAT_ROLES:
            supported = ", ".join(repr(role) for role in CHAT_ROLES)
            raise ValueError(f"invalid role {value!r}; supported roles are {supported}")
        return value

    def to_template_dict(self) -> dict[str, Any]:
        """The message as given (null content as None); ``chat_utils.template_messages`` then
        gives the content in the template's format ("" or [] for None)."""
        message = self.model_dump(exclude_none=True)
        message["content"] = message.get("content")
        return message


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (or the older
    ``max_tokens``) defaults to the model's default, else the rest of the context.

    ``add_generation_prompt`` left out means "true unless ``continue_final_message``";
    both set true is a 400 (``chat_utils.resolve_generation_prompt``, the rule of every
    way of rendering a chat). ``include_reasoning`` false (vLLM's) drops the reasoning a
    ``--reasoning-parser`` splits off. ``mm_processor_kwargs`` (vLLM's): options of an
    image-text model's processor, refused unless the server runs with --trust-request-mm-kwargs."""

    messages: list[ChatMessage] = Field(min_length=1)
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[ChatCompletionToolsParam]] = None
    tool_choice: Optional[ToolChoice] = "none"
    parallel_tool_calls: Optional[bool] = True
    functions: Any = None
    function_call: Any = None
    # vLLM extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    include_reasoning: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: Optional[int]) -> Optional[int]:
        check_logprobs(value, "top_logprobs")
        return value

    @model_validator(mode="before")
    @classmethod
    def _check_tool_choice(cls, data: Any) -> Any:
        return check_tool_choice(data)

    @model_validator(mode="after")
    def _check_chat_fields(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs can only be set when logprobs is true.")
        return self

    @property
    def requested_max_tokens(self) -> Optional[int]:
        """``max_completion_tokens``, else ``max_tokens``, else None."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_top_logprobs(self) -> Optional[int]:
        """Engine ``logprobs``: None when off, else ``top_logprobs`` (0 when unset)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self, *args: Any, **kwargs: Any) -> SamplingParams:
        """``SamplingRequest.to_sampling_params``; a ``tool_choice`` that must call a tool
        ("required" or named) sets the output constraint to ``tool_call_json_schema``
        (instead of any other, as vLLM), as compact JSON (``disable_any_whitespace``: a
        small model left free whitespace can fill ``max_tokens`` with newlines after "[").

        Raises:
            ValueError: see ``SamplingRequest.to_sampling_params`` and ``tool_call_json_schema``.
        """
        params = super().to_sampling_params(*args, **kwargs)
        schema = tool_call_json_schema(self.tools or [], self.tool_choice or "none", self.parallel_tool_calls)
        if schema is not None:
            params.structured_outputs = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return params


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatResponseMessage(OpenAIBaseModel):
    """The reply. ``reasoning`` (and ``reasoning_content``, vLLM's older name, the same
    text) is the model's thinking, with ``--reasoning-parser``; left out of the JSON when
    None."""

    role: str = "assistant"
    content: Optional[str] = None
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_no_reasoning(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("reasoning", "reasoning_content"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_logprobs: Optional[PromptLogprobsJSON] = None
    kv_transfer_params: Optional[dict[str, Any]] = None  # vLLM's: a prefill instance's answer


class DeltaMessage(DropNoneModel):
    """A streamed piece of the assistant message; unset fields are left out of the JSON."""

    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# --------------------------------------------------------------------------- models


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# --------------------------------------------------------------------------- tokenization


class TokenizeCompletionRequest(OpenAIRequest):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIRequest):
    """The chat form of ``/tokenize``: rendered exactly as ``/v1/chat/completions`` renders
    its messages (the same fields, defaults and rules)."""

    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[ChatCompletionToolsParam]] = None
    return_token_strs: bool = False


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIRequest):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# --------------------------------------------------------------------------- embeddings


class EmbeddingRequest(OpenAIRequest):
    """``POST /v1/embeddings`` (OpenAI's fields; ``truncate_prompt_tokens``, ``add_special_tokens``
    and ``normalize`` are vLLM's extras). ``input``: a string, a list of strings, a list of
    token ids, or a list of token-id lists (one embedding each, in order)."""

    model: Optional[str] = None
    input: Union[list[int], list[list[int]], str, list[str]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: bool = True
    normalize: Optional[bool] = None


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    #: The floats, or (``encoding_format`` "base64") their little-endian float32 bytes in base64.
    embedding: Union[list[float], str]


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


# --------------------------------------------------------------------------- classification and scores


class _PoolingListResponse(OpenAIBaseModel):
    """The fields every pooling list response shares (its ``id`` and ``data`` are each one's)."""

    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class ClassificationRequest(OpenAIRequest):
    """``POST /classify`` (vLLM's fields): ``input`` as ``EmbeddingRequest``'s, one
    classification each, in order."""

    model: Optional[str] = None
    input: Union[list[int], list[list[int]], str, list[str]]
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: bool = True
    use_activation: Optional[bool] = None


class ClassificationData(OpenAIBaseModel):
    index: int
    #: config.json's ``id2label`` name of the most probable class.
    label: Optional[str]
    probs: list[float]
    num_classes: int


class ClassificationResponse(_PoolingListResponse):
    id: str = Field(default_factory=lambda: f"classify-{uuid.uuid4().hex}")
    data: list[ClassificationData]


class ScoreRequest(OpenAIRequest):
    """``POST /v1/score`` / ``/score`` (vLLM's): the pairs of ``text_1`` and ``text_2`` (or
    their newer names ``queries`` and ``documents``), each a string or a list of strings:
    1:1, 1:N or N:N (``pagedllm.entrypoints.score_utils.score_pairs``)."""

    model: Optional[str] = None
    text_1: Optional[Union[str, list[str]]] = None
    text_2: Optional[Union[str, list[str]]] = None
    queries: Optional[Union[str, list[str]]] = None
    documents: Optional[Union[str, list[str]]] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    use_activation: Optional[bool] = None


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(_PoolingListResponse):
    id: str = Field(default_factory=lambda: f"score-{uuid.uuid4().hex}")
    data: list[ScoreResponseData]


class RerankRequest(OpenAIRequest):
    """``POST /v1/rerank`` / ``/rerank`` (Jina's and Cohere's shape, as vLLM): ``documents``
    ranked by their score against ``query``; ``top_n`` (0 or None: all) best kept;
    ``return_documents``: each result carries its document's text."""

    model: Optional[str] = None
    query: str
    documents: list[str]
    top_n: Optional[int] = None
    return_documents: bool = True
    truncate_prompt_tokens: Optional[int] = None
    use_activation: Optional[bool] = None


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: Optional[RerankDocument] = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{uuid.uuid4().hex}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]
