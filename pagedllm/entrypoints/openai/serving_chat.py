"""``POST /v1/chat/completions``: messages -> chat template -> one prompt -> n choices.

The prompt is the model's chat template (or ``--chat-template``, or the request's
``chat_template``) rendered by ``PromptRenderer.render_chat``; text content parts reach
it as a list when it loops over a message's content, else joined with newlines
(``--chat-template-content-format``).
``max_completion_tokens`` (or ``max_tokens``) defaults to the model's default (its
generation_config.json's ``max_new_tokens``), else the rest of the context.

Streams start with one chunk per choice carrying ``delta.role`` ("assistant"); each
choice then gets content chunks, and exactly one chunk with its ``finish_reason``.

``echo`` (vLLM's): when the last message has the reply's role, its content is put in front
of each choice's content (the first content chunk of a stream).

With ``tools`` (``tool_calls``): a ``tool_choice`` other than "none" has a tool parser read
the output into ``message.tool_calls``, streamed as ``delta.tool_calls`` by one
``ToolCallStream`` per choice.

With ``--reasoning-parser`` (``pagedllm.reasoning``): the parser splits each output into
``message.reasoning`` (also as ``reasoning_content``, vLLM's older field) and the content
(None when empty); streams carry ``delta.reasoning`` / ``delta.reasoning_content`` pieces,
then content pieces (one ``ReasoningStream`` per choice); ``include_reasoning`` false drops
the reasoning. Tool calls are read from the content only. An output the engine constrains
(structured outputs, "required" or named ``tool_choice``) is split the same way: the engine
starts its grammar where the reasoning ends (``StructuredOutputsConfig.reasoning_parser``,
which ``pagedllm serve`` sets from ``--reasoning-parser``), so the content follows it. A
prompt that ends the reasoning itself (a template closing an empty block) makes the whole
output content.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Mapping, Optional, Sequence, Union

from pagedllm.entrypoints.chat_utils import load_chat_images, media_connector, multimodal_chat_prompt, template_messages
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
from pagedllm.reasoning import ReasoningParser, ReasoningParserManager, ReasoningStream


@dataclass
class ChatRun:
    """One chat request on its way through the engine (``OpenAIServingChat.start``): its id,
    the model name it reports, its prompt, the engine's output stream (not started), and
    the parsers that read its outputs (None: not used)."""

    request_id: str
    model_name: str
    prompt: PromptInput
    stream: AsyncGenerator[tuple[int, RequestOutput], None]
    tool_parser: Optional[ToolParser]
    reasoning_parser: Optional[ReasoningParser]


class OpenAIServingChat(OpenAIServing):
    """``POST /v1/chat/completions`` (constructor: ``OpenAIServing``'s arguments,
    ``response_role`` and ``tool_parser``; the server's ``--chat-template`` is the renderer's).

    ``response_role`` (``--response-role``) is the reply's role when the request has
    ``add_generation_prompt``; without it the reply continues the last message, in its
    role (vLLM's rule). ``tool_parser`` (``--tool-call-parser``, given with
    ``--enable-auto-tool-choice``) reads calls for ``tool_choice="auto"``; None refuses "auto".
    ``reasoning_parser`` (``--reasoning-parser``) splits reasoning from content; None: off.

    Raises:
        KeyError: an unknown ``tool_parser`` or ``reasoning_parser`` name.
    """

    def __init__(
        self,
        *args: Any,
        response_role: str = "assistant",
        tool_parser: Optional[str] = None,
        reasoning_parser: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.response_role = response_role
        self.auto_tool_parser: Optional[type[ToolParser]] = (
            ToolParserManager.get_tool_parser(tool_parser) if tool_parser else None
        )
        self.reasoning_parser: Optional[type[ReasoningParser]] = (
            ReasoningParserManager.get_reasoning_parser(reasoning_parser) if reasoning_parser else None
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
        """The request's prompt; with images, each loaded (``chat_utils.load_chat_images``; an
        http(s) URL is fetched here, within its timeout) and processed by the model's processor.

        Raises:
            OpenAIServingError: 400 naming the part and the reason for an image that cannot be
                loaded or processed, or past ``--limit-mm-per-prompt``; see ``render_chat_media``.
        """
        text, images = self.renderer.render_chat_media(request)
        if not images:
            return PromptInput(text, self.renderer.encode(text, request.add_special_tokens, "messages"))
        try:
            loaded = load_chat_images(images, media_connector(self.engine.model_config),
                                      self.engine.model_config.multimodal_config.video_num_frames)
            prompt = multimodal_chat_prompt(self.processor, text, loaded, request.mm_processor_kwargs,
                                            request.add_special_tokens)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        return PromptInput(text, prompt["prompt_token_ids"], prompt["mm_features"])

    async def create_chat_completion(
        self, request: ChatCompletionRequest, trace_headers: Optional[Mapping[str, str]] = None
    ) -> Union[ChatCompletionResponse, AsyncGenerator[str, None]]:
        """A ``ChatCompletionResponse``, or (``stream``) an async generator of SSE events.
        ``trace_headers``: the caller's W3C trace context (see ``OpenAIServing.generate``).

        Raises:
            OpenAIServingError: 400 for bad input, 404 for an unknown model.
            EngineDeadError: the engine died (a 500).
        """
        if _has_images(request):  # its images load (URLs are fetched) off the event loop
            run = await asyncio.to_thread(self.start, request, random_id("chatcmpl"), trace_headers)
        else:
            run = self.start(request, random_id("chatcmpl"), trace_headers)
        if request.stream:
            run.stream = await self.start_stream(run.stream)
            events = self._stream(request, run)
            return self.sse_stream(run.request_id, events, run.stream)
        (final,) = await self.collect_final(run.stream, 1)
        return self.response(request, run, final)

    def request_reasoning_parser(
        self, request: ChatCompletionRequest, prompt: PromptInput
    ) -> Optional[ReasoningParser]:
        """The reasoning parser of a request's output (None: off, or a prompt that ends the
        reasoning itself, as a template closing an empty block does: the output is all
        content, as vLLM's ``prompt_is_reasoning_end``, and the engine constrains it from its
        first token). A parser whose markers are special tokens turns ``skip_special_tokens``
        off for the request (vLLM's ``adjust_request``)."""
        if self.reasoning_parser is None:
            return None
        parser = self.reasoning_parser(request.chat_template_kwargs)
        if parser.keeps_special_tokens:
            request.skip_special_tokens = False
        if parser.ends_reasoning(prompt.token_ids, self.renderer.tokenizer):
            return None
        return parser

    def start(
        self, request: ChatCompletionRequest, request_id: str, trace_headers: Optional[Mapping[str, str]] = None
    ) -> ChatRun:
        """Validate a request and build its engine request; nothing reaches the engine until
        ``ChatRun.stream`` is iterated (the Messages API runs chat requests this way too).
        ``trace_headers``: the caller's W3C trace context (see ``OpenAIServing.generate``).

        Raises:
            OpenAIServingError: 400 for bad input, 404 for an unknown model.
        """
        model_name = self.models.resolve(request.model)
        tool_parser = request_tool_parser(request, self.auto_tool_parser)
        prompt = self.render_prompt(request)
        reasoning_parser = self.request_reasoning_parser(request, prompt)
        engine_request = self.engine_request(
            f"{request_id}-0",
            request,
            prompt,
            prompt_param="messages",
            logprobs=request.num_top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
        )
        stream = self.generate(request_id, [prompt], [engine_request], trace_headers)
        return ChatRun(request_id, model_name, prompt, stream, tool_parser, reasoning_parser)

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
        self, request: ChatCompletionRequest, output: CompletionOutput, run: ChatRun
    ) -> tuple[ChatResponseMessage, Optional[str]]:
        """A choice's message and finish_reason (reasoning split off by the run's reasoning
        parser, then tool calls read from the content by its tool parser)."""
        role = self._role(request)
        text: Optional[str] = output.text
        reasoning = None
        if run.reasoning_parser is not None:
            reasoning, text = run.reasoning_parser.extract_reasoning(output.text, output.token_ids,
                                                                     self.renderer.tokenizer)
            reasoning = reasoning if request.include_reasoning else None
        if run.tool_parser is None:
            message = ChatResponseMessage(role=role, content=text, reasoning=reasoning, reasoning_content=reasoning)
            return message, output.finish_reason
        content, tool_calls = reply_tool_calls(request, run.tool_parser.parse(text or "", final=True))
        message = ChatResponseMessage(
            role=role, content=(content or None) if run.reasoning_parser else content, reasoning=reasoning,
            reasoning_content=reasoning, tool_calls=tool_calls,
        )  # fmt: skip
        return message, finish_reason(request, output.finish_reason, bool(tool_calls))

    def response(self, request: ChatCompletionRequest, run: ChatRun, final: RequestOutput) -> ChatCompletionResponse:
        """The non-streamed response of a run's final output."""
        num_top = request.num_top_logprobs
        echo = self._echo(request)
        choices = []
        for output in final.outputs:
            message, reason = self._message(request, output, run)
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
        reasoning_tokens = self._reasoning_tokens(run, [output.token_ids for output in final.outputs])
        return ChatCompletionResponse(
            id=run.request_id,
            model=run.model_name,
            choices=choices,
            usage=make_usage(len(final.prompt_token_ids), num_generated, final.num_cached_tokens, reasoning_tokens),
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs) if request.prompt_logprobs is not None else None,
            kv_transfer_params=final.kv_transfer_params,
        )

    def _reasoning_tokens(self, run: ChatRun, outputs: Sequence[Sequence[int]]) -> Optional[int]:
        """Usage's ``reasoning_tokens`` of a run's choices' token ids: None without
        ``--reasoning-parser``, 0 when the prompt ended the reasoning, else the parser's
        ``count_reasoning_tokens`` summed over the choices."""
        if self.reasoning_parser is None:
            return None
        if run.reasoning_parser is None:
            return 0
        return sum(run.reasoning_parser.count_reasoning_tokens(ids, self.renderer.tokenizer) for ids in outputs)

    async def _stream(self, request: ChatCompletionRequest, run: ChatRun) -> AsyncGenerator[str, None]:
        # NOTE: without include_usage the "usage" key is left out, as OpenAI does.
        exclude = None if request.include_usage or request.continuous_usage else {"usage"}
        async for chunk in self.stream_chunks(request, run):
            yield sse(chunk.model_dump_json(exclude=exclude if chunk.choices else None))

    async def stream_chunks(
        self, request: ChatCompletionRequest, run: ChatRun
    ) -> AsyncGenerator[ChatCompletionStreamResponse, None]:
        """The chunks of a started run's stream (``start_stream``): the role chunks, the echo,
        the deltas, then (``include_usage``) one chunk with no choices and the usage."""
        created = int(time.time())
        tool_streams = [ToolCallStream(request, run.tool_parser) for _ in range(request.n)] if run.tool_parser else None
        parser = run.reasoning_parser
        tokenizer = self.renderer.tokenizer
        reasoning_streams = [ReasoningStream(parser, tokenizer) for _ in range(request.n)] if parser else None
        num_generated = [0] * request.n
        generated: list[list[int]] = [[] for _ in range(request.n)]  # for the reasoning count
        num_cached = 0

        def chunk(
            choices: list[ChatCompletionResponseStreamChoice], final: bool = False
        ) -> ChatCompletionStreamResponse:
            usage = None
            if final or request.continuous_usage:
                usage = make_usage(len(run.prompt.token_ids), sum(num_generated), num_cached,
                                   self._reasoning_tokens(run, generated))
            return ChatCompletionStreamResponse(
                id=run.request_id, created=created, model=run.model_name, choices=choices, usage=usage
            )

        for index in range(request.n):
            role = DeltaMessage(role=self._role(request), content="")
            yield chunk([ChatCompletionResponseStreamChoice(index=index, delta=role)])
        echo = self._echo(request)
        for index in range(request.n if echo else 0):
            yield chunk([ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(content=echo))])
        async for _, output in run.stream:
            num_cached = output.num_cached_tokens or num_cached
            for completion in output.outputs:
                num_generated[completion.index] += len(completion.token_ids)
                if parser is not None:
                    generated[completion.index].extend(completion.token_ids)
                tool_stream = tool_streams[completion.index] if tool_streams else None
                reasoning_stream = reasoning_streams[completion.index] if reasoning_streams else None
                choice = self._stream_choice(request, completion, tool_stream, reasoning_stream)
                if choice is not None:
                    yield chunk([choice])
        if request.include_usage:
            yield chunk([], final=True)

    def _stream_choice(
        self,
        request: ChatCompletionRequest,
        completion: CompletionOutput,
        tool_stream: Optional[ToolCallStream],
        reasoning_stream: Optional[ReasoningStream],
    ) -> Optional[ChatCompletionResponseStreamChoice]:
        """The streamed choice of one completion's new output, or None when it carries nothing."""
        num_top = request.num_top_logprobs
        finished = completion.finish_reason is not None
        logprobs = None
        if num_top is not None and completion.token_ids:
            logprobs = self._logprobs(request, completion.token_ids, completion.logprobs)
        reason = completion.finish_reason
        text, reasoning = completion.text, None
        if reasoning_stream is not None:
            reasoning, text = reasoning_stream.feed(text, finished, completion.token_ids)
        if tool_stream is None:
            delta = DeltaMessage(content=text if text or not (finished or reasoning_stream) else None)
        else:
            delta = tool_stream.feed(text, finished)
            reason = finish_reason(request, reason, tool_stream.called)
        delta.reasoning = delta.reasoning_content = (reasoning or None) if request.include_reasoning else None
        if not delta.content and not delta.reasoning and not delta.tool_calls and logprobs is None and not finished:
            return None
        return ChatCompletionResponseStreamChoice(
            index=completion.index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=reason,
            stop_reason=completion.stop_reason,
        )


def _has_images(request: ChatCompletionRequest) -> bool:
    """Whether a message of ``request`` has an ``image_url`` or ``video_url`` part."""
    return any(isinstance(m.content, list) and any(part.type in ("image_url", "video_url") for part in m.content)
               for m in request.messages)
