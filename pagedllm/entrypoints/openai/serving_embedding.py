"""``POST /v1/embeddings`` on a pooling model (vLLM's ``serving_embedding``, OpenAI's shape).

Request path (``OpenAIServingPooling``'s steps)::

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
import numpy as np

from pagedllm.entrypoints.openai.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    UsageInfo,
)
from pagedllm.entrypoints.openai.serving_engine import random_id
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedllm.pooling_params import PoolingParams


#: Request fields a ``PoolingParams`` error message may start with (they become ``param``).
EMBEDDING_FIELDS = ("dimensions", "truncate_prompt_tokens", "normalize")


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """``embedding`` as the response carries it: the floats, or ("base64") the base64 text of
    their little-endian float32 bytes (what OpenAI's SDK decodes)."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


class OpenAIServingEmbedding(OpenAIServingPooling):
    """``POST /v1/embeddings``."""

    param_fields = EMBEDDING_FIELDS

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """The embeddings of every input, in order.

        Raises:
            OpenAIServingError: 400 for bad input or an input too long, 404 for an unknown model.
            EngineDeadError: the engine died (a 500).
        """
        model_name = self.models.resolve(request.model)
        prompts = self._prompt_inputs(request.input, request.add_special_tokens)
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize,
                               truncate_prompt_tokens=request.truncate_prompt_tokens)
        request_id = random_id("embd")
        outputs = await self._pool_inputs(request_id, prompts, params)
        data = [EmbeddingResponseData(index=i, embedding=encode_embedding(out.outputs.data, request.encoding_format))
                for i, out in enumerate(outputs)]
        num_prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)
        return EmbeddingResponse(id=request_id, model=model_name, data=data, usage=usage)
