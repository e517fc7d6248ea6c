"""``POST /v1/chat/completions``: messages -> chat template -> one prompt -> n choices.

The prompt is the model's chat template (or ``--chat-template``, or the request's
``chat_template``) rendered by ``tokenizer.apply_chat_template``; text content parts are
joined with newlines first, so templates that expect string content work too.
``max_completion_tokens`` (or ``max_tokens``) defaults to the rest of the context.

Streams start with one chunk per choice carrying ``delta.role == "assistant"``; each
choice then gets content chunks, and exactly one chunk with its ``finish_reason``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, AsyncGenerator, Optional, Sequence, Union

import jinja2

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    make_usage,
)
from pagedllm.entrypoints.openai.serving_completion import (
    OpenAIServing,
    PromptInput,
    clamp_logprob,
    prompt_logprobs_json,
    random_id,
    sse,
    top_entries,
)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput

logger = logging.getLogger(__name__)

#: Keyword arguments of ``apply_chat_template`` a request's ``chat_template_kwargs`` may not set.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"}
)  # fmt: skip


def render_chat_prompt(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    chat_template: Optional[str],
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: Optional[dict[str, Any]],
) -> str:
    """The prompt text of a conversation.

    ``chat_template`` None means the tokenizer's own. With ``continue_final_message`` the
    last (assistant) message is left open and no generation prompt is added.

    Raises:
        OpenAIServingError: 400 when there is no template or it fails on these messages.
    """
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise bad_request(
            "This model has no chat template; start the server with --chat-template "
            "(a file or a Jinja string) or pass chat_template in the request.",
            param="messages",
        )
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}.", param="chat_template_kwargs")
    conversation = [message.to_template_dict() for message in messages]
    try:
        return tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise bad_request(f"Cannot apply the chat template to these messages: {exc}", param="messages") from None


class OpenAIServingChat(OpenAIServing):
    """``POST /v1/chat/completions``.

    Args:
        chat_template: the server's ``--chat-template`` text, or None for the tokenizer's.
        (others: see ``OpenAIServing``)
    """

    def __init__(
        self,
        engine: Any,
        models: OpenAIServingModels,
        tokenizer: Any,
        *,
        chat_template: Optional[str] = None,
        log_requests: bool = True,
    ) -> None:
        super().__init__(engine, models, tokenizer, log_requests=log_requests)
        self.chat_template = chat_template

    def render_prompt(self, request: ChatCompletionRequest) -> PromptInput:
        text = render_chat_prompt(
            self.tokenizer,
            request.messages,
            request.chat_template or self.chat_template,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
        )
        return PromptInput(text, self.encode(text, request.add_special_tokens))

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> Union[ChatCompletionResponse, AsyncGenerator[str, None]]:
        """A ``ChatCompletionResponse``, or (``stream``) an async generator of SSE events.

        Raises:
            OpenAIServingError: 400 for bad input, 404 for an unknown model.
            EngineDeadError: the engine died (a 500).
        """
        model_name = self.models.resolve(request.model)
        prompt = self.render_prompt(request)
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens_for(len(prompt.token_ids), request.requested_max_tokens, None, param, "messages")
        params = self.sampling_params(request, max_tokens, request.num_top_logprobs, request.prompt_logprobs)
        self.validate_prompt(prompt, params)
        request_id = random_id("chatcmpl")
        stream = self.generate(request_id, [prompt], [params], request.cache_salt)
        if request.stream:
            stream = await self.start_stream(stream)
            events = self._stream(request, request_id, model_name, prompt, stream)
            return self.sse_stream(request_id, events, stream)
        (final,) = await self.collect_final(stream, 1)
        return self._response(request, request_id, model_name, final)

    def _logprobs(
        self, token_ids: Sequence[int], positions: Optional[Sequence[PositionLogprobs]], num_top: int
    ) -> ChatCompletionLogProbs:
        """OpenAI's chat logprobs: per token, its text, logprob, bytes and the ``num_top``
        most likely tokens."""
        content = []
        for token_id, position in zip(token_ids, positions or [{}] * len(token_ids)):
            chosen = position.get(token_id)
            content.append(
                ChatCompletionLogProbsContent(
                    token=self.token_text(token_id, chosen),
                    logprob=clamp_logprob(chosen.logprob) if chosen is not None else -9999.0,
                    bytes=self.token_bytes(token_id),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=self.token_text(tid, lp), logprob=clamp_logprob(lp.logprob), bytes=self.token_bytes(tid)
                        )
                        for tid, lp in top_entries(position, num_top)
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)

    def _response(
        self, request: ChatCompletionRequest, request_id: str, model_name: str, final: RequestOutput
    ) -> ChatCompletionResponse:
        num_top = request.num_top_logprobs
        choices = [
            ChatCompletionResponseChoice(
                index=output.index,
                message=ChatResponseMessage(content=output.text),
                logprobs=self._logprobs(output.token_ids, output.logprobs, num_top) if num_top is not None else None,
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
            )
            for output in final.outputs
        ]
        num_generated = sum(len(output.token_ids) for output in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=make_usage(len(final.prompt_token_ids), num_generated, final.num_cached_tokens),
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs) if request.prompt_logprobs is not None else None,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model_name: str,
        prompt: PromptInput,
        stream: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        num_generated = [0] * request.n
        num_cached = 0
        # NOTE: without include_usage the "usage" key is left out, as OpenAI does.
        exclude = None if request.include_usage or request.continuous_usage else {"usage"}

        def event(choices: list[ChatCompletionResponseStreamChoice], final: bool = False) -> str:
            usage = None
            if final or request.continuous_usage:
                usage = make_usage(len(prompt.token_ids), sum(num_generated), num_cached)
            chunk = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model_name, choices=choices, usage=usage
            )
            return sse(chunk.model_dump_json(exclude=None if final else exclude))

        for index in range(request.n):
            role = DeltaMessage(role="assistant", content="")
            yield event([ChatCompletionResponseStreamChoice(index=index, delta=role)])
        async for _, output in stream:
            num_cached = output.num_cached_tokens or num_cached
            for completion in output.outputs:
                num_generated[completion.index] += len(completion.token_ids)
                choice = self._stream_choice(request, completion)
                if choice is not None:
                    yield event([choice])
        if request.include_usage:
            yield event([], final=True)

    def _stream_choice(
        self, request: ChatCompletionRequest, completion: CompletionOutput
    ) -> Optional[ChatCompletionResponseStreamChoice]:
        """The streamed choice of one completion's new output, or None when it carries nothing."""
        num_top = request.num_top_logprobs
        finished = completion.finish_reason is not None
        logprobs = None
        if num_top is not None and completion.token_ids:
            logprobs = self._logprobs(completion.token_ids, completion.logprobs, num_top)
        if not completion.text and logprobs is None and not finished:
            return None
        return ChatCompletionResponseStreamChoice(
            index=completion.index,
            delta=DeltaMessage(content=completion.text if completion.text or not finished else None),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """``--chat-template``: the text of a file, or the value itself when it is Jinja.

    As vLLM: a value naming a readable file is read; otherwise a value containing any of
    ``{``, ``}`` or a newline is taken as the template itself.

    Raises:
        ValueError: neither a file nor a template, or a template with a syntax error.
    """
    if value is None:
        return None
    text: Optional[str] = None
    try:
        path = Path(value).expanduser()
        if path.is_file():
            text = path.read_text(encoding="utf-8")
    except OSError:  # e.g. a long literal template is not a valid file name
        text = None
    if text is None:
        if not any(char in value for char in "{}\n"):
            raise ValueError(
                f"--chat-template {value!r} is neither a readable file nor a Jinja template."
            )
        text = value
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template has a Jinja syntax error (line {exc.lineno}): {exc.message}") from None
    return text
