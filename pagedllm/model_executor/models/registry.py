"""Architecture name (config.json ``architectures[0]``) -> model class."""

from __future__ import annotations

from torch import nn

from pagedllm.model_executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from pagedllm.model_executor.models.gpt_oss import GptOssForCausalLM
from pagedllm.model_executor.models.llama_eagle import Eagle3LlamaForCausalLM, EagleLlamaForCausalLM
from pagedllm.model_executor.models.mixtral import MixtralForCausalLM
from pagedllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # Mixture of experts (``FusedMoE``).
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
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
