"""What every pooling endpoint does with its inputs (``/v1/embeddings``, ``/classify``,
``/v1/score``, ``/v1/rerank``): validate each input into an ``EngineCoreRequest`` before any
reaches the engine (``Processor.process_pooling``: a bad field, a task the model does not
serve, an input longer than ``max_model_len`` is a 400 in OpenAI's error JSON), then pool
them all at once (``AsyncLLM.encode``) and return the outputs in input order.
"""

from __future__ import annotations

import logging
from typing import Union

from pagedllm.engine.processor import ContextLengthError, PromptType
from pagedllm.entrypoints.openai.errors import from_value_error, bad_request
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, PromptInput, merge_async_iterators
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

logger = logging.getLogger(__name__)


class OpenAIServingPooling(OpenAIServing):
    """A pooling endpoint's shared steps. ``param_fields``: request fields that a
    ``PoolingParams`` error message may start with (they become the error's ``param``)."""

    param_fields: tuple[str, ...] = ("truncate_prompt_tokens",)

    def _prompt_inputs(self, given: Union[str, list[str], list[int], list[list[int]]],
                       add_special_tokens: bool) -> list[PromptInput]:
        """One ``PromptInput`` per input: a string, a list of strings, a list of token ids or a
        list of token-id lists (texts tokenized with ``add_special_tokens``).

        Raises:
            OpenAIServingError: 400 for an empty ``input`` list.
        """
        if isinstance(given, str):
            given = [given]
        if not given:
            raise bad_request("input must not be empty.", param="input")
        if isinstance(given[0], int):
            return [PromptInput(None, list(given))]  # type: ignore[arg-type]
        if isinstance(given[0], list):
            return [PromptInput(None, list(ids)) for ids in given]  # type: ignore[arg-type]
        return [PromptInput(text, self.renderer.encode(text, add_special_tokens, "input"))  # type: ignore[arg-type]
                for text in given]

    async def _pool_inputs(self, request_id: str, prompts: list[PromptInput],
                           params: PoolingParams) -> list[PoolingRequestOutput]:
        """Every input pooled with ``params``, in order (ids ``{request_id}-{i}``), each
        validated (``_engine_request``) before any is queued.

        Raises:
            OpenAIServingError: 400 for bad input or an input too long.
        """
        engine_requests = [self._engine_request(f"{request_id}-{i}", prompt.engine_prompt, params)
                           for i, prompt in enumerate(prompts)]
        if self.log_requests:
            logger.info("Received request %s: %d input(s) of %s tokens, params: %s", request_id, len(prompts),
                        [len(r.prompt_token_ids) for r in engine_requests], engine_requests[0].pooling_params)
        return await self._collect([p.text for p in prompts], engine_requests)

    def _engine_request(self, request_id: str, prompt: Union[PromptType, dict], params: PoolingParams,
                        input_param: str = "input") -> EngineCoreRequest:
        """One input's validated engine request; ``input_param`` names the input's field in errors.

        Raises:
            OpenAIServingError: 400 for a bad field, a task the model does not serve, or an
                input longer than ``max_model_len``.
        """
        try:
            engine_request, _ = self.processor.process_pooling(request_id, prompt, params)
        except ContextLengthError as exc:
            error = bad_request(str(exc), param=input_param, code="context_length_exceeded")
        except ValueError as exc:
            error = from_value_error(exc, self.param_fields)
        else:
            return engine_request
        error.request_id = request_id
        raise error from None

    async def _collect(self, prompt_texts: list[Union[str, None]],
                       engine_requests: list[EngineCoreRequest]) -> list[PoolingRequestOutput]:
        """Every input's output, in order (``AsyncLLM.encode``, all inputs at once).

        Raises:
            OpenAIServingError: 400 when the engine rejects an input.
        """
        stream = merge_async_iterators([
            self.engine.encode(request, None, request.request_id, prompt_text=text)
            for text, request in zip(prompt_texts, engine_requests)
        ])
        return await self.collect_final(stream, len(engine_requests))  # type: ignore[arg-type, return-value]
