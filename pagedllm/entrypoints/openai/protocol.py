"""Request and response bodies of the OpenAI HTTP API (pydantic v2), with vLLM's extras.

Field names, types and defaults follow OpenAI's API reference for ``/v1/completions`` and
``/v1/chat/completions``; the extra sampling fields (``top_k``, ``min_p``, ``ignore_eos``
...) and ``/tokenize`` / ``/detokenize`` follow vLLM's OpenAI server. Unknown fields are
ignored, as both servers do.

A body that does not validate becomes a 400 ``invalid_request_error`` (see ``errors``).
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from pagedllm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams

#: Largest ``n`` a request may ask for (each choice is a separate engine request).
MAX_N = 128


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


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


class UsageInfo(OpenAIBaseModel):
    """Token counts: the prompt counted once per prompt, completions summed over choices."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: Optional[float] = 0.0
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
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
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    cache_salt: Optional[str] = None

    @model_validator(mode="after")
    def _check_stream_options(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        return self

    @field_validator("n", mode="before")
    @classmethod
    def _default_n(cls, value: Any) -> Any:
        return 1 if value is None else value

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value:
            raise ValueError("cache_salt must be a non-empty string when given.")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def to_sampling_params(
        self, max_tokens: int, logprobs: Optional[int], prompt_logprobs: Optional[int]
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` (DELTA outputs when streaming, else FINAL_ONLY).

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
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=self.min_p or 0.0,
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
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
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
    ids, or a list of token-id lists; ``max_tokens`` unset or null means the default, 16
    (``DEFAULT_MAX_TOKENS``, cut to the room the prompt leaves; see ``Processor``)."""

    prompt: Union[list[int], list[list[int]], str, list[str]]
    max_tokens: Optional[int] = None
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    # vLLM extras
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_unsupported(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix is not supported.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be unset or equal to n).")
        return self


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


# --------------------------------------------------------------------------- chat


class ChatContentPart(OpenAIBaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: Optional[str] = None

    @model_validator(mode="after")
    def _check_text(self) -> "ChatContentPart":
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text' parts are.")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' field.")
        return self


class ChatMessage(OpenAIBaseModel):
    """One message. Extra fields (``tool_calls``, ``tool_call_id`` ...) are kept and passed
    to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, list[ChatContentPart]]] = None
    name: Optional[str] = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it; text parts are joined with newlines."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text or "" for part in self.content)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (or the older
    ``max_tokens``) defaults to the rest of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check_chat_fields(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs can only be set when logprobs is true.")
        if self.continue_final_message and self.add_generation_prompt and (
            "add_generation_prompt" in self.model_fields_set
        ):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than {'type': 'text'} is not supported.")
        if self.tools and self.tool_choice != "none":
            raise ValueError("tool calling is not supported; send the request without tools.")
        return self

    @property
    def requested_max_tokens(self) -> Optional[int]:
        """``max_completion_tokens``, else ``max_tokens``, else None (rest of the context)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> Optional[int]:
        """Engine ``logprobs``: None when off, else ``top_logprobs`` (0 when unset)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: Optional[str] = None


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


class DeltaMessage(OpenAIBaseModel):
    """A streamed piece of the assistant message; unset fields are left out of the JSON."""

    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


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


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
