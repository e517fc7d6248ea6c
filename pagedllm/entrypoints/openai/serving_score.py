"""``POST /v1/score`` (and ``/score``) and ``POST /v1/rerank`` (and ``/rerank``) on a pooling
model (vLLM's ``serving_score``).

Both score text pairs (``pagedllm.entrypoints.score_utils``): a sequence classifier with one
label (a cross-encoder) pools each pair as one input (``score_prompts``: the tokenizer's pair
encoding, or with the server's ``--chat-template`` as the score template, e.g.
Qwen3-Reranker's) into its activated logit; an embedding model (a bi-encoder) embeds each distinct text once and
scores the cosine of the two embeddings. ``/v1/score`` returns the scores in pair order;
``/v1/rerank`` the documents sorted by ``relevance_score`` (best first), cut to ``top_n``.
Bad input (empty lists, unequal lengths, a classifier with several labels, a pair longer
than ``max_model_len``) is a 400 in OpenAI's error JSON. ``usage.prompt_tokens`` counts the
tokens the model read.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import jinja2

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
    UsageInfo,
)
from pagedllm.entrypoints.openai.serving_engine import random_id
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedllm.entrypoints.score_utils import check_cross_encoder, cosine_similarity, score_pairs, score_prompts
from pagedllm.pooling_params import PoolingParams

logger = logging.getLogger(__name__)


def _score_inputs(request: ScoreRequest) -> tuple[Union[str, list[str]], Union[str, list[str]]]:
    """The request's two inputs: ``text_1`` / ``text_2``, or ``queries`` / ``documents``.

    Raises:
        OpenAIServingError: 400 when neither pair, or parts of both, are given.
    """
    old, new = (request.text_1, request.text_2), (request.queries, request.documents)
    given = [pair for pair in (old, new) if any(x is not None for x in pair)]
    if len(given) != 1 or any(x is None for x in given[0]):
        raise bad_request("Give either text_1 and text_2, or queries and documents.", param="text_1")
    return given[0]  # type: ignore[return-value]


class OpenAIServingScores(OpenAIServingPooling):
    """``POST /v1/score`` and ``POST /v1/rerank``."""

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        """The score of every pair, in pair order.

        Raises:
            OpenAIServingError: 400 for bad input; 404 for an unknown model.
            EngineDeadError: the engine died (a 500).
        """
        model_name = self.models.resolve(request.model)
        text_1, text_2 = _score_inputs(request)
        request_id = random_id("score")
        scores, num_tokens = await self._score(request_id, text_1, text_2, request.truncate_prompt_tokens,
                                               request.use_activation)
        data = [ScoreResponseData(index=i, score=score) for i, score in enumerate(scores)]
        return ScoreResponse(id=request_id, model=model_name, data=data,
                             usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))

    async def do_rerank(self, request: RerankRequest) -> RerankResponse:
        """``documents`` sorted by their score against ``query`` (best first), the ``top_n`` best.

        Raises:
            OpenAIServingError: 400 for bad input (``top_n`` below 0 among it); 404 for an unknown model.
            EngineDeadError: the engine died (a 500).
        """
        model_name = self.models.resolve(request.model)
        if request.top_n is not None and request.top_n < 0:
            raise bad_request(f"top_n must be 0 (all) or more, got {request.top_n}.", param="top_n")
        request_id = random_id("rerank")
        scores, num_tokens = await self._score(request_id, request.query, request.documents,
                                               request.truncate_prompt_tokens, request.use_activation,
                                               first_param="query", second_param="documents")
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n or None]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=request.documents[i]) if request.return_documents else None)
                   for i in ranked]
        return RerankResponse(id=request_id, model=model_name, results=results,
                              usage=RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

    async def _score(self, request_id: str, text_1: Union[str, list[str]], text_2: Union[str, list[str]],
                     truncate_prompt_tokens: Optional[int], use_activation: Optional[bool],
                     first_param: str = "text_1", second_param: str = "text_2") -> tuple[list[float], int]:
        """(the score of each pair, the tokens read) by the model's kind (module docstring).

        Raises:
            OpenAIServingError: 400 for bad pairs, a bad field, or an input too long.
        """
        try:
            pairs = score_pairs(text_1, text_2)
            model_config = self.processor.model_config
            if model_config.is_classifier:
                check_cross_encoder(model_config)
        except ValueError as exc:
            raise bad_request(str(exc), param=second_param if "text_2" in str(exc) else first_param) from None
        if self.log_requests:
            logger.info("Received request %s: %d pair(s)", request_id, len(pairs))
        if model_config.is_classifier:
            return await self._cross_encoding_score(request_id, pairs, truncate_prompt_tokens, use_activation,
                                                    second_param)
        return await self._embedding_score(request_id, pairs, truncate_prompt_tokens)

    async def _cross_encoding_score(self, request_id: str, pairs: list[tuple[str, str]],
                                    truncate_prompt_tokens: Optional[int], use_activation: Optional[bool],
                                    input_param: str) -> tuple[list[float], int]:
        """Each pair pooled as one input (``score_prompts``; the server's ``--chat-template`` is the
        score template) into its activated logit."""
        params = PoolingParams(task="score", use_activation=use_activation)
        try:
            prompts = score_prompts(self.processor.model_config, self.renderer.tokenizer, pairs, truncate_prompt_tokens,
                                    self.renderer.chat_template)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise bad_request(f"The score template failed on this pair: {exc}", param=input_param) from None
        engine_requests = [self._engine_request(f"{request_id}-{i}", prompt, params, input_param)
                           for i, prompt in enumerate(prompts)]
        outputs = await self._collect([None] * len(pairs), engine_requests)
        return [out.outputs.data[0] for out in outputs], sum(len(out.prompt_token_ids) for out in outputs)

    async def _embedding_score(self, request_id: str, pairs: list[tuple[str, str]],
                               truncate_prompt_tokens: Optional[int]) -> tuple[list[float], int]:
        """Each distinct text embedded once; each pair the cosine of its two embeddings."""
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        params = PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
        prompts = self._prompt_inputs(texts, add_special_tokens=True)
        outputs = dict(zip(texts, await self._pool_inputs(request_id, prompts, params)))
        scores = [cosine_similarity(outputs[a].outputs.data, outputs[b].outputs.data) for a, b in pairs]
        return scores, sum(len(outputs[a].prompt_token_ids) + len(outputs[b].prompt_token_ids) for a, b in pairs)
