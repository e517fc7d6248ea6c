"""``POST /v1/chat/completions``: messages -> chat template -> one prompt -> n choices.

The prompt is the model's chat template (or ``--chat-template``, or the request's
``chat_template``) rendered by ``PromptRenderer.render_chat``; text content parts are
joined with newlines first, so templates that expect string content work too.
``max_completion_tokens`` (or ``max_tokens``) defaults to the model's default (its
generation_config.json's ``max_new_tokens``), else the rest of the context.

Streams start with one chunk per choice carrying ``delta.role`` ("assistant"); each
choice then gets content chunks, and exactly one chunk with its ``finish_reason``.

``echo`` (vLLM's): when the last message has the reply's role, its content is put in front
of each choice's content (the first content chunk of a stream).

With ``tools`` (``tool_calls``): a ``tool_choice`` other than "none" has a tool parser read
the output into ``message.tool_calls``, streamed as ``delta.tool_calls`` by one
``ToolCallStream`` per choice.
"""

from __future__ import annotations

import time
from typing import Any, AsyncGenerator, Optional, Sequence, Union

from pagedllm.entrypoints.chat_utils import template_messages
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    make_usage,
)
from pagedllm.entrypoints.openai.logprobs import clamp_logprob, prompt_logprobs_json, top_entries
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, PromptInput, random_id, sse
from pagedllm.entrypoints.openai.tool_calls import (
    ToolCallStream,
    finish_reason,
    reply_tool_calls,
    request_tool_parser,
)
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput

class OpenAIServingChat(OpenAIServing):
    """``POST /v1/chat/completions`` (constructor: ``OpenAIServing``'s arguments,
    ``response_role`` and ``tool_parser``; the server's ``--chat-template`` is the renderer's).

    ``response_role`` (``--response-role``) is the reply's role when the request has
    ``add_generation_prompt``; without it the reply continues the last message, in its
    role (vLLM's rule). ``tool_parser`` (``--tool-call-parser``, given with
    ``--enable-auto-tool-choice``) reads calls for ``tool_choice="auto"``; None refuses "auto".

    Raises:
        KeyError: an unknown ``tool_parser`` name.
    """

    def __init__(
        self, *args: Any, response_role: str = "assistant", tool_parser: Optional[str] = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.response_role = response_role
        self.auto_tool_parser: Optional[type[ToolParser]] = (
            ToolParserManager.get_tool_parser(tool_parser) if tool_parser else None
        )

    def _role(self, request: ChatCompletionRequest) -> str:
        return self.response_role if request.add_generation_prompt else request.messages[-1].role

    def _echo(self, request: ChatCompletionRequest) -> str:
        """What ``echo`` puts in front of each reply: the last message's text when it has the
        reply's role (vLLM's rule), else nothing."""
        last = request.messages[-1]
        if not request.echo or last.role != self._role(request):
            return ""
        return template_messages([last.to_template_dict()])[0]["content"]

    def render_prompt(self, request: ChatCompletionRequest) -> PromptInput:
        text = self.renderer.render_chat(request)
        return PromptInput(text, self.renderer.encode(text, request.add_special_tokens))

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> Union[ChatCompletionResponse, AsyncGenerator[str, None]]:
        """A ``ChatCompletionResponse``, or (``stream``) an async generator of SSE events.

        Raises:
            OpenAIServingError: 400 for bad input, 404 for an unknown model.
            EngineDeadError: the engine died (a 500).
        """
        model_name = self.models.resolve(request.model)
        tool_parser = request_tool_parser(request, self.auto_tool_parser)
        prompt = self.render_prompt(request)
        request_id = random_id("chatcmpl")
        engine_request = self.engine_request(
            f"{request_id}-0",
            request,
            prompt,
            prompt_param="messages",
            logprobs=request.num_top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
        )
        stream = self.generate(request_id, [prompt], [engine_request])
        if request.stream:
            stream = await self.start_stream(stream)
            events = self._stream(request, request_id, model_name, prompt, stream, tool_parser)
            return self.sse_stream(request_id, events, stream)
        (final,) = await self.collect_final(stream, 1)
        return self._response(request, request_id, model_name, final, tool_parser)

    def _logprobs(
        self, request: ChatCompletionRequest, token_ids: Sequence[int], positions: Optional[Sequence[PositionLogprobs]]
    ) -> ChatCompletionLogProbs:
        """OpenAI's chat logprobs: per token, its text (or ``"token_id:{id}"``, see
        ``tokens_as_ids``), logprob, bytes and the request's ``top_logprobs`` most likely tokens."""
        num_top = request.num_top_logprobs or 0
        as_ids = self.tokens_as_ids(request)
        content = []
        for token_id, position in zip(token_ids, positions or [{}] * len(token_ids)):
            chosen = position.get(token_id)
            content.append(
                ChatCompletionLogProbsContent(
                    token=self.token_text(token_id, chosen, as_ids),
                    logprob=clamp_logprob(chosen.logprob) if chosen is not None else -9999.0,
                    bytes=self.token_bytes(token_id),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=self.token_text(tid, lp, as_ids),
                            logprob=clamp_logprob(lp.logprob),
                            bytes=self.token_bytes(tid),
                        )
                        for tid, lp in top_entries(position, num_top)
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)

    def _message(
        self, request: ChatCompletionRequest, output: CompletionOutput, tool_parser: Optional[ToolParser]
    ) -> tuple[ChatResponseMessage, Optional[str]]:
        """A choice's message and finish_reason (tool calls read by ``tool_parser``)."""
        if tool_parser is None:
            return ChatResponseMessage(role=self._role(request), content=output.text), output.finish_reason
        content, tool_calls = reply_tool_calls(request, tool_parser.parse(output.text, final=True))
        message = ChatResponseMessage(role=self._role(request), content=content, tool_calls=tool_calls)
        return message, finish_reason(request, output.finish_reason, bool(tool_calls))

    def _response(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model_name: str,
        final: RequestOutput,
        tool_parser: Optional[ToolParser],
    ) -> ChatCompletionResponse:
        num_top = request.num_top_logprobs
        echo = self._echo(request)
        choices = []
        for output in final.outputs:
            message, reason = self._message(request, output, tool_parser)
            if echo:
                message.content = echo + (message.content or "")
            choices.append(
                ChatCompletionResponseChoice(
                    index=output.index,
                    message=message,
                    logprobs=self._logprobs(request, output.token_ids, output.logprobs) if num_top is not None else None,
                    finish_reason=reason,
                    stop_reason=output.stop_reason,
                )
            )
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
        tool_parser: Optional[ToolParser],
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        tool_streams = [ToolCallStream(request, tool_parser) for _ in range(request.n)] if tool_parser else None
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
            role = DeltaMessage(role=self._role(request), content="")
            yield event([ChatCompletionResponseStreamChoice(index=index, delta=role)])
        echo = self._echo(request)
        for index in range(request.n if echo else 0):
            yield event([ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(content=echo))])
        async for _, output in stream:
            num_cached = output.num_cached_tokens or num_cached
            for completion in output.outputs:
                num_generated[completion.index] += len(completion.token_ids)
                tool_stream = tool_streams[completion.index] if tool_streams else None
                choice = self._stream_choice(request, completion, tool_stream)
                if choice is not None:
                    yield event([choice])
        if request.include_usage:
            yield event([], final=True)

    def _stream_choice(
        self, request: ChatCompletionRequest, completion: CompletionOutput, tool_stream: Optional[ToolCallStream]
    ) -> Optional[ChatCompletionResponseStreamChoice]:
        """The streamed choice of one completion's new output, or None when it carries nothing."""
        num_top = request.num_top_logprobs
        finished = completion.finish_reason is not None
        logprobs = None
        if num_top is not None and completion.token_ids:
            logprobs = self._logprobs(request, completion.token_ids, completion.logprobs)
        reason = completion.finish_reason
        if tool_stream is None:
            delta = DeltaMessage(content=completion.text if completion.text or not finished else None)
        else:
            delta = tool_stream.feed(completion.text, finished)
            reason = finish_reason(request, reason, tool_stream.called)
        if not delta.content and not delta.tool_calls and logprobs is None and not finished:
            return None
        return ChatCompletionResponseStreamChoice(
            index=completion.index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=reason,
            stop_reason=completion.stop_reason,
        )


