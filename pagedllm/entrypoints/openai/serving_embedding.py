"""``POST /v1/embeddings`` on a pooling model (vLLM's ``serving_embedding``, OpenAI's shape).

Request path::

    EmbeddingRequest --tokenize (PromptRenderer), PoolingParams, Processor.process_pooling-->
        one EngineCoreRequest per input --AsyncLLM.encode--> PoolingRequestOutput
        --> EmbeddingResponse (floats, or base64 of little-endian float32 bytes)

Every input is checked before any reaches the engine: a bad field, a ``dimensions`` the
model does not support (not Matryoshka), or an input longer than ``max_model_len`` (after
``truncate_prompt_tokens``) is a 400 in OpenAI's error JSON. ``usage.prompt_tokens``
counts every input's tokens.
"""

from __future__ import annotations

import base64
import logging
import numpy as np

from pagedllm.engine.processor import ContextLengthError
from pagedllm.entrypoints.openai.errors import bad_request, from_value_error
from pagedllm.entrypoints.openai.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    UsageInfo,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, PromptInput, merge_async_iterators, random_id
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

logger = logging.getLogger(__name__)

#: Request fields a ``PoolingParams`` error message may start with (they become ``param``).
EMBEDDING_FIELDS = ("dimensions", "truncate_prompt_tokens", "normalize")


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """``embedding`` as the response carries it: the floats, or ("base64") the base64 text of
    their little-endian float32 bytes (what OpenAI's SDK decodes)."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


class OpenAIServingEmbedding(OpenAIServing):
    """``POST /v1/embeddings``."""

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """The embeddings of every input, in order.

        Raises:
            OpenAIServingError: 400 for bad input or an input too long, 404 for an unknown model.
            EngineDeadError: the engine died (a 500).
        """
        model_name = self.models.resolve(request.model)
        prompts = self._prompt_inputs(request)
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize,
                               truncate_prompt_tokens=request.truncate_prompt_tokens)
        request_id = random_id("embd")
        engine_requests = [self._engine_request(f"{request_id}-{i}", prompt, params)
                           for i, prompt in enumerate(prompts)]
        if self.log_requests:
            logger.info("Received request %s: %d input(s) of %s tokens, params: %s", request_id, len(prompts),
                        [len(r.prompt_token_ids) for r in engine_requests], engine_requests[0].pooling_params)
        outputs = await self._collect(prompts, engine_requests)
        data = [EmbeddingResponseData(index=i, embedding=encode_embedding(out.outputs.data, request.encoding_format))
                for i, out in enumerate(outputs)]
        num_prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)
        return EmbeddingResponse(id=request_id, model=model_name, data=data, usage=usage)

    def _prompt_inputs(self, request: EmbeddingRequest) -> list[PromptInput]:
        """One ``PromptInput`` per input (texts tokenized with ``add_special_tokens``).

        Raises:
            OpenAIServingError: 400 for an empty ``input`` list.
        """
        given = request.input
        if isinstance(given, str):
            given = [given]
        if not given:
            raise bad_request("input must not be empty.", param="input")
        if isinstance(given[0], int):
            return [PromptInput(None, list(given))]  # type: ignore[arg-type]
        if isinstance(given[0], list):
            return [PromptInput(None, list(ids)) for ids in given]  # type: ignore[arg-type]
        return [PromptInput(text, self.renderer.encode(text, request.add_special_tokens))  # type: ignore[arg-type]
                for text in given]

    def _engine_request(self, request_id: str, prompt: PromptInput, params: PoolingParams) -> EngineCoreRequest:
        """One input's validated engine request (``Processor.process_pooling``).

        Raises:
            OpenAIServingError: 400 for a bad field or an input longer than ``max_model_len``.
        """
        try:
            engine_request, _ = self.processor.process_pooling(request_id, prompt.engine_prompt, params)
        except ContextLengthError as exc:
            error = bad_request(str(exc), param="input", code="context_length_exceeded")
        except ValueError as exc:
            error = from_value_error(exc, EMBEDDING_FIELDS)
        else:
            return engine_request
        error.request_id = request_id
        raise error from None

    async def _collect(self, prompts: list[PromptInput],
                       engine_requests: list[EngineCoreRequest]) -> list[PoolingRequestOutput]:
        """Every input's output, in order (``AsyncLLM.encode``, all inputs at once).

        Raises:
            OpenAIServingError: 400 when the engine rejects an input.
        """
        stream = merge_async_iterators([
            self.engine.encode(request, None, request.request_id, prompt_text=prompt.text)
            for prompt, request in zip(prompts, engine_requests)
        ])
        return await self.collect_final(stream, len(prompts))  # type: ignore[arg-type, return-value]
