"""``POST /v1/completions`` (``OpenAIServing`` is in ``serving_engine``).

Request path (vLLM's OpenAI layer)::

    CompletionRequest --tokenize, validate (Processor)--> N EngineCoreRequests
        --AsyncLLM.generate (one engine request per prompt, n choices inside)-->
        merge_async_iterators --> (prompt index, RequestOutput)
        --> one JSON response (FINAL_ONLY outputs), or SSE chunks (DELTA outputs)

Choice ``index`` is ``prompt_index * n + i``. ``echo`` with ``max_tokens: 0`` generates one
token and drops it (``_shown``), so the choice holds the prompt alone. Streams end with
``data: [DONE]``; an error after the first byte is sent as one ``data: {"error": ...}``
event before ``[DONE]``. Cancelling or closing a stream (client disconnect) closes the
engine generators, which aborts the requests in the engine.
"""

from __future__ import annotations

import dataclasses
import time
from typing import AsyncGenerator, Mapping, Optional, Sequence, Union

from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    make_usage,
)
from pagedllm.entrypoints.openai.logprobs import clamp_logprob, prompt_logprobs_json, top_entries
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, PromptInput, random_id, sse
from pagedllm.outputs import CompletionOutput, PositionLogprobs, PromptLogprobs, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    """``POST /v1/completions``."""

    async def create_completion(
        self, request: CompletionRequest, trace_headers: Optional[Mapping[str, str]] = None
    ) -> Union[CompletionResponse, AsyncGenerator[str, None]]:
        """A ``CompletionResponse``, or (``stream``) an async generator of SSE events.
        ``trace_headers``: the caller's W3C trace context (see ``OpenAIServing.generate``).

        Raises:
            OpenAIServingError: 400 for bad input, 404 for an unknown model.
            EngineDeadError: the engine died (a 500).
        """
        model_name = self.models.resolve(request.model)
        prompts = self._prompt_inputs(request)
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        request_id = random_id("cmpl")
        engine_requests = [
            self.engine_request(
                f"{request_id}-{i}",
                request,
                prompt,
                prompt_param="prompt",
                logprobs=request.logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            for i, prompt in enumerate(prompts)
        ]
        stream = self.generate(request_id, prompts, engine_requests, trace_headers)
        if request.stream:
            stream = await self.start_stream(stream)
            events = self._stream(request, request_id, model_name, prompts, stream)
            return self.sse_stream(request_id, events, stream)
        finals = await self.collect_final(stream, len(prompts))
        return self._response(request, request_id, model_name, prompts, finals)

    def _prompt_inputs(self, request: CompletionRequest) -> list[PromptInput]:
        prompt = request.prompt
        if isinstance(prompt, str):
            texts: list[str] = [prompt]
        elif prompt and isinstance(prompt[0], str):
            texts = list(prompt)  # type: ignore[arg-type]
        elif prompt and isinstance(prompt[0], list):
            return [PromptInput(None, list(ids)) for ids in prompt]  # type: ignore[arg-type]
        else:
            return [PromptInput(None, list(prompt))]  # type: ignore[arg-type]
        return [PromptInput(text, self.renderer.encode(text, request.add_special_tokens)) for text in texts]

    def _echo_text(self, prompt: PromptInput) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _logprobs(
        self,
        token_ids: Sequence[int],
        positions: Sequence[Optional[PositionLogprobs]],
        num_top: int,
        initial_offset: int,
        as_ids: bool,
    ) -> CompletionLogProbs:
        """OpenAI's completions logprobs. ``top_logprobs`` holds the ``num_top`` most likely
        tokens plus the chosen one; a position without logprobs (the first prompt token)
        has nulls. ``as_ids``: tokens named ``"token_id:{id}"``."""
        result = CompletionLogProbs()
        offset = initial_offset
        for token_id, position in zip(token_ids, positions):
            chosen = position.get(token_id) if position else None
            token = self.token_text(token_id, chosen, as_ids)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if chosen is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(clamp_logprob(chosen.logprob))
            top = {
                self.token_text(tid, lp, as_ids): clamp_logprob(lp.logprob) for tid, lp in top_entries(position, num_top)
            }
            top.setdefault(token, clamp_logprob(chosen.logprob))
            result.top_logprobs.append(top)
        return result

    def _choice_logprobs(
        self,
        request: CompletionRequest,
        prompt: PromptInput,
        prompt_logprobs: Optional[PromptLogprobs],
        token_ids: list[int],
        positions: Optional[list[PositionLogprobs]],
        with_prompt: bool,
        initial_offset: int,
    ) -> Optional[CompletionLogProbs]:
        if request.logprobs is None:
            return None
        all_ids: list[int] = list(token_ids)
        all_positions: list[Optional[PositionLogprobs]] = list(positions or [None] * len(token_ids))
        if with_prompt:
            prompt_positions = list(prompt_logprobs or [])
            prompt_positions += [None] * (len(prompt.token_ids) - len(prompt_positions))
            all_ids = prompt.token_ids + all_ids
            all_positions = prompt_positions + all_positions
        return self._logprobs(all_ids, all_positions, request.logprobs, initial_offset, self.tokens_as_ids(request))

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        prompts: list[PromptInput],
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        choices = []
        num_prompt_tokens = num_generated = num_cached = 0
        for prompt_index, (prompt, final) in enumerate(zip(prompts, finals)):
            num_prompt_tokens += len(final.prompt_token_ids)
            num_cached += final.num_cached_tokens
            for engine_output in final.outputs:
                output = _shown(request, engine_output)
                num_generated += len(output.token_ids)
                text = self._echo_text(prompt) + output.text if request.echo else output.text
                logprobs = self._choice_logprobs(
                    request, prompt, final.prompt_logprobs, output.token_ids, output.logprobs, request.echo, 0
                )
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_index * request.n + output.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                        prompt_logprobs=(
                            prompt_logprobs_json(final.prompt_logprobs) if request.prompt_logprobs is not None else None
                        ),
                    )
                )
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=make_usage(num_prompt_tokens, num_generated, num_cached),
            kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None,
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        prompts: list[PromptInput],
        stream: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncGenerator[str, None]:
        state = _StreamState(request, request_id, model_name, prompts)
        async for prompt_index, output in stream:
            state.num_cached[prompt_index] = output.num_cached_tokens or state.num_cached[prompt_index]
            state.prompt_logprobs[prompt_index].extend(output.prompt_logprobs or [])
            for completion in output.outputs:
                event = self._stream_event(request, state, prompt_index, _shown(request, completion))
                if event is not None:
                    yield event
        if request.include_usage:
            yield state.event([], state.usage())

    def _stream_event(
        self, request: CompletionRequest, state: "_StreamState", prompt_index: int, completion: CompletionOutput
    ) -> Optional[str]:
        """The SSE event of one choice's new output, or None when it carries nothing."""
        prompt = state.prompts[prompt_index]
        index = prompt_index * request.n + completion.index
        first = not state.started[index]
        state.started[index] = True
        state.num_generated[index] += len(completion.token_ids)
        echo = first and request.echo
        text = self._echo_text(prompt) + completion.text if echo else completion.text
        logprobs = self._choice_logprobs(
            request, prompt, state.prompt_logprobs[prompt_index], completion.token_ids, completion.logprobs,
            echo, state.offsets[index],
        )  # fmt: skip
        if logprobs is not None and not logprobs.tokens:
            logprobs = None
        if logprobs is not None:
            state.offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if not text and logprobs is None and completion.finish_reason is None:
            return None
        send_prompt_logprobs = first and request.prompt_logprobs is not None
        choice = CompletionResponseStreamChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_logprobs=prompt_logprobs_json(state.prompt_logprobs[prompt_index]) if send_prompt_logprobs else None,
        )
        return state.event([choice], state.usage() if request.continuous_usage else None)


def _shown(request: CompletionRequest, output: CompletionOutput) -> CompletionOutput:
    """What the client gets of ``output``: for ``request.echo_only``, not the one token
    generated (vLLM's rule for ``echo`` with ``max_tokens: 0``), else all of it."""
    if not request.echo_only:
        return output
    return dataclasses.replace(output, text="", token_ids=[], cumulative_logprob=None, logprobs=None)


class _StreamState:
    """What a streamed completions request has sent so far, per choice and per prompt."""

    def __init__(self, request: CompletionRequest, request_id: str, model_name: str, prompts: list[PromptInput]) -> None:
        num_choices = len(prompts) * request.n
        self.request_id = request_id
        self.model_name = model_name
        self.created = int(time.time())
        self.prompts = prompts
        self.started = [False] * num_choices
        self.offsets = [0] * num_choices  # text_offset of each choice's next token
        self.num_generated = [0] * num_choices
        self.num_cached = [0] * len(prompts)
        self.prompt_logprobs: list[PromptLogprobs] = [[] for _ in prompts]
        self.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        # NOTE: without include_usage the "usage" key is left out, as OpenAI does.
        self.exclude = None if request.include_usage or request.continuous_usage else {"usage"}

    def usage(self) -> UsageInfo:
        return make_usage(self.num_prompt_tokens, sum(self.num_generated), sum(self.num_cached))

    def event(self, choices: list[CompletionResponseStreamChoice], usage: Optional[UsageInfo]) -> str:
        chunk = CompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )
        return sse(chunk.model_dump_json(exclude=None if not choices else self.exclude))


__all__ = ["OpenAIServingCompletion"]
