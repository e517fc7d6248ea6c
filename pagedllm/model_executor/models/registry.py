"""Architecture name (config.json ``architectures[0]``) -> model class, with the example
checkpoints and features docs/models.md lists (``markdown_page``; running this module prints
the page, tests/model_executor/test_registry.py fails when the file is out of date). Each
class is imported when it is first asked for (``MODEL_REGISTRY``, ``get_model_class``)."""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from torch import nn


@functools.cache
def _load_class(module: str, class_name: str, seq_cls: bool) -> type[nn.Module]:
    """``class_name`` of ``pagedllm.model_executor.models.<module>`` (``as_seq_cls_model`` of it
    when ``seq_cls``), the same class object on every call."""
    cls = getattr(importlib.import_module(f"pagedllm.model_executor.models.{module}"), class_name)
    if seq_cls:
        from pagedllm.model_executor.models.adapters import as_seq_cls_model

        cls = as_seq_cls_model(cls)
    return cls


@dataclass(frozen=True)
class SupportedModel:
    """One architecture: its class (``class_name`` in ``pagedllm.model_executor.models.<module>``,
    wrapped by ``as_seq_cls_model`` when ``seq_cls``), Hugging Face checkpoints of it, what its
    code does."""

    module: str
    class_name: str
    examples: tuple[str, ...]
    features: str
    seq_cls: bool = False

    @property
    def model_cls(self) -> type[nn.Module]:
        """The class, imported on first use (``_load_class``)."""
        return _load_class(self.module, self.class_name, self.seq_cls)


SUPPORTED_MODELS: dict[str, SupportedModel] = {
    "LlamaForCausalLM": SupportedModel(
        "llama", "LlamaForCausalLM", ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
        "llama3 rope scaling; attention / MLP bias"),
    "MistralForCausalLM": SupportedModel(
        "llama", "MistralForCausalLM", ("mistralai/Mistral-7B-Instruct-v0.3",), "sliding window on every layer"),
    "Qwen2ForCausalLM": SupportedModel(
        "llama", "Qwen2ForCausalLM", ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
        "q/k/v bias; sliding window on the layers past max_window_layers"),
    "Qwen3ForCausalLM": SupportedModel(
        "llama", "Qwen3ForCausalLM", ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"), "per-head q/k RMSNorm; sliding window by layer_types"),
    "Olmo2ForCausalLM": SupportedModel(
        "olmo2", "Olmo2ForCausalLM", ("allenai/OLMo-2-1124-7B-Instruct", "allenai/OLMo-2-0425-1B-Instruct"),
        "q/k RMSNorm over the whole projections; norms after each block"),
    "GraniteForCausalLM": SupportedModel(
        "granite", "GraniteForCausalLM", ("ibm-granite/granite-3.3-8b-instruct", "ibm-granite/granite-3.1-2b-instruct"),
        "embedding / residual / attention multipliers; logits scaling"),
    "Gemma2ForCausalLM": SupportedModel(
        "gemma2", "Gemma2ForCausalLM", ("google/gemma-2-9b-it", "google/gemma-2-2b-it"),
        "(1 + w) RMSNorms before and after each block; GeGLU; sliding window on alternate layers; attention "
        "and final logit soft-capping"),
    "Gemma3ForCausalLM": SupportedModel(
        "gemma3", "Gemma3ForCausalLM", ("google/gemma-3-1b-it",),
        "(1 + w) RMSNorms before and after each block; GeGLU; per-head q/k norm; sliding window by layer_types "
        "with its own rope base; final logit soft-capping"),
    # Image-text models with their vision encoder (images in ``multi_modal_data`` / chat ``image_url`` parts).
    "Gemma3ForConditionalGeneration": SupportedModel(
        "gemma3_mm", "Gemma3ForConditionalGeneration", ("google/gemma-3-4b-it", "google/gemma-3-27b-it"),
        "SigLIP vision tower, average-pooled and RMS-normed projector; Gemma 3 language model; bidirectional "
        "attention within each image's tokens (an image is never split across prefill chunks); pan-and-scan "
        "crops with mm_processor_kwargs {\"do_pan_and_scan\": true}"),
    "LlavaForConditionalGeneration": SupportedModel(
        "llava", "LlavaForConditionalGeneration", ("llava-hf/llava-1.5-7b-hf", "llava-hf/llava-1.5-13b-hf"),
        "CLIP vision tower and MLP projector (vision_feature_layer, vision_feature_select_strategy); Llama "
        "language model; images through the checkpoint's own processor, encoder cache, image-keyed prefix caching"),
    "Mistral3ForConditionalGeneration": SupportedModel(
        "mistral3", "Mistral3ForConditionalGeneration", ("mistralai/Mistral-Small-3.1-24B-Instruct-2503",),
        "Pixtral vision tower (2-D rope, images at their own size), patch-merging projector; Mistral language "
        "model; [IMG] tokens take the image's embeddings, [IMG_BREAK] / [IMG_END] keep theirs"),
    "Qwen2_5_VLForConditionalGeneration": SupportedModel(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", ("Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct"),
        "images in (windowed vision transformer, multimodal RoPE); no video"),
    "Qwen3VLForConditionalGeneration": SupportedModel(
        "qwen3_vl", "Qwen3VLForConditionalGeneration", ("Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"),
        "images in (vision transformer with DeepStack features, interleaved multimodal RoPE); no video"),
    "Phi3ForCausalLM": SupportedModel(
        "phi3", "Phi3ForCausalLM", ("microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3.5-mini-instruct", "microsoft/Phi-4-mini-instruct"),
        "fused q/k/v and gate/up checkpoints; sliding window on every layer; longrope; partial rotary (Phi-4-mini)"),
    "Glm4ForCausalLM": SupportedModel(
        "glm4", "Glm4ForCausalLM", ("THUDM/GLM-4-9B-0414", "THUDM/GLM-Z1-9B-0414"),
        "norms before and after each block; q/k/v bias; partial rotary in interleaved pairs"),
    # Mixture of experts (``FusedMoE``).
    "MixtralForCausalLM": SupportedModel(
        "mixtral", "MixtralForCausalLM", ("mistralai/Mixtral-8x7B-Instruct-v0.1",), "mixture of experts (FusedMoE); sliding window"),
    "Qwen2MoeForCausalLM": SupportedModel(
        "qwen2_moe", "Qwen2MoeForCausalLM", ("Qwen/Qwen1.5-MoE-A2.7B-Chat", "Qwen/Qwen2-57B-A14B-Instruct"),
        "mixture of experts (FusedMoE) with a gated shared expert; q/k/v bias"),
    "Qwen3MoeForCausalLM": SupportedModel(
        "qwen3_moe", "Qwen3MoeForCausalLM", ("Qwen/Qwen3-30B-A3B",), "mixture of experts (FusedMoE); per-head q/k RMSNorm"),
    "Llama4ForCausalLM": SupportedModel(
        "llama4", "Llama4ForCausalLM", (),
        "chunked local attention (its own KV-cache group) with rope and L2 q/k norms on 3 of 4 layers; NoPE "
        "layers with attention temperature tuning; mixture of experts (FusedMoE) with a sigmoid top-1 router, "
        "the weight on the expert's input, and a shared expert"),
    "Llama4ForConditionalGeneration": SupportedModel(
        "llama4", "Llama4ForConditionalGeneration", ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "meta-llama/Llama-4-Maverick-17B-128E-Instruct"),
        "text-only: the language model of the image-text checkpoint (as Llama4ForCausalLM; the vision tower "
        "is not loaded)"),
    "GptOssForCausalLM": SupportedModel(
        "gpt_oss", "GptOssForCausalLM", ("openai/gpt-oss-20b", "openai/gpt-oss-120b"),
        "mixture of experts (FusedMoE) with biased experts and clamped SwiGLU; attention sinks; sliding window on "
        "alternate layers; YaRN; MXFP4 experts dequantized at load"),
    # Linear attention (Gated DeltaNet, on the state cache) beside gated full attention.
    "Qwen3NextForCausalLM": SupportedModel(
        "qwen3_next", "Qwen3NextForCausalLM", ("Qwen/Qwen3-Next-80B-A3B-Instruct",),
        "Gated DeltaNet linear attention (state cache) in three of four layers; gated attention with partial "
        "rotary; mixture of experts (FusedMoE) with a gated shared expert"),
    "Qwen3_5ForCausalLM": SupportedModel(
        "qwen3_5", "Qwen3_5ForCausalLM", ("Qwen/Qwen3.5-27B",),
        "Qwen3-Next's Gated DeltaNet and gated attention; dense MLP (checkpoints saved as Qwen3_5ForCausalLM: the "
        "Hub's image-text Qwen3_5ForConditionalGeneration is not served yet)"),
    "Qwen3_5MoeForCausalLM": SupportedModel(
        "qwen3_5", "Qwen3_5MoeForCausalLM", ("Qwen/Qwen3.5-35B-A3B",),
        "Qwen3-Next's Gated DeltaNet and gated attention; mixture of experts on every layer (checkpoints saved as "
        "Qwen3_5MoeForCausalLM: the Hub's image-text Qwen3_5MoeForConditionalGeneration is not served yet)"),
    # Multi-head latent attention (``TORCH_MLA``) with DeepSeekMoE.
    "DeepseekV2ForCausalLM": SupportedModel(
        "deepseek_v2", "DeepseekV2ForCausalLM", ("deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek-ai/DeepSeek-V2.5"),
        "multi-head latent attention (latent KV cache, TORCH_MLA); DeepSeekMoE with shared experts; softmax / "
        "group-limited routing"),
    "DeepseekV3ForCausalLM": SupportedModel(
        "deepseek_v2", "DeepseekV3ForCausalLM", ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1"),
        "multi-head latent attention (latent KV cache, TORCH_MLA); DeepSeekMoE with shared experts; sigmoid "
        "router with score bias and grouped top-k; YaRN"),
    # Encoders for embeddings (``--runner pooling``, chosen by ``--runner auto``).
    "BertModel": SupportedModel(
        "bert", "BertModel", ("sentence-transformers/all-MiniLM-L6-v2", "BAAI/bge-small-en-v1.5"),
        "encoder (bidirectional attention, one pass per prompt); embeddings only"),
    "RobertaModel": SupportedModel(
        "bert", "RobertaModel", ("sentence-transformers/all-distilroberta-v1",),
        "encoder; positions offset by the padding index; embeddings only"),
    "XLMRobertaModel": SupportedModel(
        "bert", "XLMRobertaModel", ("intfloat/multilingual-e5-small", "BAAI/bge-m3"),
        "encoder; positions offset by the padding index; embeddings only"),
    "ModernBertModel": SupportedModel(
        "modernbert", "ModernBertModel", ("Alibaba-NLP/gte-modernbert-base", "nomic-ai/modernbert-embed-base"),
        "encoder; rope with a global / local base; local (sliding-window) attention on all but every "
        "global_attn_every_n_layers-th layer; GeGLU; embeddings only"),
    # Recurrent state in the state cache (``MambaMixer2``).
    "Mamba2ForCausalLM": SupportedModel(
        "mamba2", "Mamba2ForCausalLM", ("mistralai/Mamba-Codestral-7B-v0.1",),
        "Mamba-2 mixers on every layer (state cache, no attention); gated RMSNorm; n_groups"),
    "BambaForCausalLM": SupportedModel(
        "bamba", "BambaForCausalLM", ("ibm-ai-platform/Bamba-9B",),
        "Mamba-2 mixers (state cache) interleaved with full-attention layers (attn_layer_indices); partial rotary"),
    "GraniteMoeHybridForCausalLM": SupportedModel(
        "granitemoehybrid", "GraniteMoeHybridForCausalLM", ("ibm-granite/granite-4.0-h-tiny", "ibm-granite/granite-4.0-h-1b"),
        "Mamba-2 mixers (state cache) and full attention by layer_types; rope or none; Granite's multipliers; "
        "shared MLP plus routed experts, or dense"),
    "FalconH1ForCausalLM": SupportedModel(
        "falcon_h1", "FalconH1ForCausalLM", ("tiiuae/Falcon-H1-1.5B-Deep-Instruct", "tiiuae/Falcon-H1-7B-Instruct"),
        "attention and a Mamba-2 mixer side by side in every layer (paged KV cache and state cache); optional "
        "gated RMSNorm; µP multipliers"),
    "NemotronHForCausalLM": SupportedModel(
        "nemotron_h", "NemotronHForCausalLM", ("nvidia/Nemotron-H-8B-Base-8K", "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
                               "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"),
        "one mixer per layer by hybrid_override_pattern: Mamba-2 (state cache), attention without rope, relu2 MLP, "
        "routed relu2 experts (FusedMoE; sigmoid router with score bias and grouped top-k) plus a shared expert"),
    # Sequence classifiers (``--runner pooling``, chosen by ``--runner auto``): classify, score, rerank.
    "BertForSequenceClassification": SupportedModel(
        "bert", "BertForSequenceClassification", ("cross-encoder/ms-marco-MiniLM-L6-v2",),
        "encoder; pooler dense + tanh, classifier on the CLS token; pairs as token types 0 / 1"),
    "RobertaForSequenceClassification": SupportedModel(
        "bert", "RobertaForSequenceClassification", ("cross-encoder/stsb-roberta-base",),
        "encoder; classification head (dense + tanh, out_proj) on the <s> token"),
    "XLMRobertaForSequenceClassification": SupportedModel(
        "bert", "XLMRobertaForSequenceClassification", ("BAAI/bge-reranker-v2-m3",),
        "encoder; classification head (dense + tanh, out_proj) on the <s> token"),
    "ModernBertForSequenceClassification": SupportedModel(
        "modernbert", "ModernBertForSequenceClassification", ("Alibaba-NLP/gte-reranker-modernbert-base",),
        "encoder (ModernBertModel's); head (dense, activation, norm) and classifier on the classifier_pooling "
        "(cls / mean) state"),
    "Qwen3ForSequenceClassification": SupportedModel(
        "llama", "Qwen3ForCausalLM", ("tomaarsen/Qwen3-Reranker-0.6B-seq-cls", "Qwen/Qwen3-Reranker-0.6B"),
        "decoder; score head on the last token; Qwen3-Reranker's Qwen3ForCausalLM checkpoints with vLLM's "
        "hf_overrides (classifier_from_token [\"no\", \"yes\"], is_original_qwen3_reranker) and the model card's "
        "prompt as the score template (--chat-template)", seq_cls=True),
    "Qwen2ForSequenceClassification": SupportedModel(
        "llama", "Qwen2ForCausalLM", ("jason9693/Qwen2.5-1.5B-apeach",),
        "decoder; score head on the last token", seq_cls=True),
    "LlamaForSequenceClassification": SupportedModel(
        "llama", "LlamaForCausalLM", ("Skywork/Skywork-Reward-V2-Llama-3.1-8B",),
        "decoder; score head on the last token", seq_cls=True),
    # Speculative-decoding heads (``speculative_config`` methods "eagle" / "eagle3").
    "EagleLlamaForCausalLM": SupportedModel(
        "llama_eagle", "EagleLlamaForCausalLM", ("yuhuili/EAGLE-LLaMA3.1-Instruct-8B",), "EAGLE draft head (speculative_config)"),
    "Eagle3LlamaForCausalLM": SupportedModel(
        "llama_eagle", "Eagle3LlamaForCausalLM", ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",), "EAGLE-3 draft head (speculative_config)"),
}

class _LazyRegistry(Mapping[str, type[nn.Module]]):
    """Architecture -> model class, importing a model's module only when its class is asked
    for: a server imports the one module it serves, not all of them (the image and encoder
    models' modules pull in transformers' activations, and with them torch.distributed.tensor
    and sympy: about 0.6 s of a start)."""

    def __getitem__(self, architecture: str) -> type[nn.Module]:
        return SUPPORTED_MODELS[architecture].model_cls

    def __iter__(self) -> Iterator[str]:
        return iter(SUPPORTED_MODELS)

    def __len__(self) -> int:
        return len(SUPPORTED_MODELS)

    def __contains__(self, architecture: object) -> bool:
        return architecture in SUPPORTED_MODELS


MODEL_REGISTRY: Mapping[str, type[nn.Module]] = _LazyRegistry()

#: Families of unsupported architectures (a test on the name -> what pagedllm lacks for them).
_FAMILIES = (
    (("Moe", "MoE", "Mixtral", "Deepseek", "GptOss", "Dbrx", "Arctic"),
     "it is a mixture-of-experts model whose routing and expert weights are not mapped onto FusedMoE yet"),
    (("Mamba", "Jamba", "Zamba", "Bamba", "FalconH1", "NemotronH", "Hybrid", "Rwkv", "Next"),
     "it keeps a recurrent (state-space / linear-attention) state in layers pagedllm does not build yet (its "
     "state cache serves Mamba2ForCausalLM, BambaForCausalLM, GraniteMoeHybridForCausalLM, FalconH1ForCausalLM, "
     "NemotronHForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM)"),
    (("ConditionalGeneration", "Llava", "VL", "Vision", "Mllama", "Idefics", "PaliGemma", "Pixtral", "Siglip"),
     "it is an image-text model whose vision encoder pagedllm does not build yet (it serves "
     "LlavaForConditionalGeneration's, Gemma3ForConditionalGeneration's and Mistral3ForConditionalGeneration's)"),
)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for ``architecture``.

    Raises:
        ValueError: for an unsupported architecture: the message names the closest supported
            ones (difflib) and, for a known family (mixture of experts, recurrent state,
            image-text), what pagedllm lacks for it.
    """
    if architecture not in SUPPORTED_MODELS:
        raise ValueError(unsupported_message(architecture))
    return SUPPORTED_MODELS[architecture].model_cls


def unsupported_message(architecture: str) -> str:
    """The error text for an ``architecture`` not in ``MODEL_REGISTRY``."""
    parts = [f"Model architecture {architecture!r} is not supported yet"]
    lowered = architecture.lower()
    missing = next((why for names, why in _FAMILIES if any(n.lower() in lowered for n in names)), None)
    if missing:
        parts.append(f": {missing}")
    close = difflib.get_close_matches(architecture, list(MODEL_REGISTRY), n=3, cutoff=0.6)
    if close:
        parts.append(f". Closest supported: {', '.join(close)}")
    parts.append(f". Supported architectures: {', '.join(sorted(MODEL_REGISTRY))} (docs/models.md).")
    return "".join(parts)


def markdown_page() -> str:
    """The text of docs/models.md: a table of ``SUPPORTED_MODELS``."""
    rows = [
        f"| `{arch}` | {', '.join(f'`{name}`' for name in model.examples)} | {model.features} |"
        for arch, model in SUPPORTED_MODELS.items()
    ]
    return "\n".join([
        "# Supported models",
        "",
        "<!-- Written by `python -m pagedllm.model_executor.models.registry > docs/models.md`; "
        "tests/model_executor/test_registry.py fails when it is out of date. -->",
        "",
        "The architectures pagedllm serves, by the `architectures` entry of a checkpoint's "
        "config.json. Each reads its config as transformers' modeling code does; a config.json "
        "setting something the code would ignore is refused at load, naming the key "
        "(`pagedllm/arch_config.py`). Greedy output is tested token-identical to transformers "
        "(float32) on tiny checkpoints of each architecture (tests/models/).",
        "",
        "| architecture | example models | features |",
        "| --- | --- | --- |",
        *rows,
        "",
    ])  # fmt: skip


if __name__ == "__main__":
    print(markdown_page(), end="")
