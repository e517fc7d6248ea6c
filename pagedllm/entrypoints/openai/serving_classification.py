"""``POST /classify`` on a sequence classifier (vLLM's ``serving_classification``).

Each input (``OpenAIServingPooling``'s steps) pools into the model's logits, which go through
its activation (softmax, or sigmoid for one label or a multi-label model:
``ModelConfig.pooling_activations``; ``use_activation`` false: raw logits). A result carries the
probabilities, their count and the most probable class's ``id2label`` name.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    UsageInfo,
)
from pagedllm.entrypoints.openai.serving_engine import random_id
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedllm.pooling_params import PoolingParams


def label_of(probs: list[float], id2label: dict) -> str:
    """The ``id2label`` name of the most probable class (its index as text when unnamed)."""
    best = max(range(len(probs)), key=probs.__getitem__)
    return str(id2label.get(best, id2label.get(str(best), best)))


class OpenAIServingClassification(OpenAIServingPooling):
    """``POST /classify``."""

    async def create_classify(self, request: ClassificationRequest) -> ClassificationResponse:
        """The class probabilities of every input, in order.

        Raises:
            OpenAIServingError: 400 for bad input, an input too long, or a model that is not a
                classifier; 404 for an unknown model.
            EngineDeadError: the engine died (a 500).
        """
        model_name = self.models.resolve(request.model)
        prompts = self._prompt_inputs(request.input, request.add_special_tokens)
        params = PoolingParams(task="classify", truncate_prompt_tokens=request.truncate_prompt_tokens,
                               use_activation=request.use_activation)
        request_id = random_id("classify")
        outputs = await self._pool_inputs(request_id, prompts, params)
        id2label = getattr(self.processor.model_config.hf_config, "id2label", None) or {}
        data = [ClassificationData(index=i, label=label_of(out.outputs.data, id2label), probs=out.outputs.data,
                                   num_classes=len(out.outputs.data)) for i, out in enumerate(outputs)]
        num_prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)
        return ClassificationResponse(id=request_id, model=model_name, data=data, usage=usage)
