"""Architecture name (config.json ``architectures[0]``) -> model class."""

from __future__ import annotations

from torch import nn

from pagedllm.model_executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from pagedllm.model_executor.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from pagedllm.model_executor.models.granite import GraniteForCausalLM
from pagedllm.model_executor.models.llama_eagle import Eagle3LlamaForCausalLM, EagleLlamaForCausalLM
from pagedllm.model_executor.models.olmo2 import Olmo2ForCausalLM
from pagedllm.model_executor.models.phi3 import Phi3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    # Speculative-decoding heads (``speculative_config`` methods "eagle" / "eagle3").
    "EagleLlamaForCausalLM": EagleLlamaForCausalLM,
    "Eagle3LlamaForCausalLM": Eagle3LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for ``architecture``.

    Raises:
        ValueError: for an unsupported architecture; the message lists the supported ones.
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported yet. "
            f"Supported architectures: {', '.join(sorted(MODEL_REGISTRY))}."
        ) from None
