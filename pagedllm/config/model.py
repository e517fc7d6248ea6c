"""``ModelConfig``: the model, its compute dtype, context length and generation config."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from pagedllm import envs
from pagedllm.arch_config import layer_attention_chunk_sizes, min_sliding_window, model_context_len
from pagedllm.config.multimodal import MultiModalConfig
from pagedllm.config.pooler import (
    PoolerConfig,
    classification_activation,
    cross_encoder_activation,
    is_classifier,
    is_encoder_architecture,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

#: dtype names accepted by ``--dtype`` -> torch dtype attribute names.
DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def resolve_dtype(dtype: Any, hf_config: PretrainedConfig, log: bool = True) -> torch.dtype:
    """The compute dtype for ``dtype`` ("auto", a name, or a torch.dtype).

    "auto" takes the checkpoint's dtype, except float32 (and float16 on CPU) become the
    platform's 16-bit type, as vLLM does; the choice is logged (INFO) when ``log`` is True.

    Raises:
        ValueError: for an unknown dtype name.
    """
    import torch

    from pagedllm.platforms import current_platform

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        try:
            return getattr(torch, DTYPES[str(dtype)])
        except KeyError:
            raise ValueError(f"Unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}.") from None
    # NOTE: transformers >= 4.56 names it ``dtype`` and warns on every ``torch_dtype`` read.
    if hasattr(hf_config, "dtype"):
        config_dtype = hf_config.dtype
    else:
        config_dtype = getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, DTYPES.get(config_dtype, "float32"))
    if config_dtype in (None, torch.float32):
        chosen, why = current_platform.half_dtype(), "16-bit for a float32 checkpoint, as vLLM"
    elif config_dtype == torch.float16 and not current_platform.is_cuda:
        chosen, why = torch.bfloat16, "for a float16 checkpoint on CPU, as vLLM: float16 activations overflow sooner"
    else:
        chosen, why = config_dtype, "the checkpoint's"
    if log:
        logger.info("--dtype auto: %s (%s)", str(chosen).removeprefix("torch."), why)
    return chosen


#: ``--generation-config`` values that are not a folder (vLLM's): the model's own
#: generation_config.json, or vLLM's neutral sampling defaults.
GENERATION_CONFIG_MODES = ("auto", "vllm")

#: generation_config.json fields that set default sampling parameters (vLLM's list);
#: ``max_new_tokens`` becomes ``max_tokens``.
_GENERATION_CONFIG_SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
_logged_generation_defaults: set = set()


@dataclass(frozen=True)
class ModelConfig:
    """The model: where it is, its HF config, the compute dtype and context length (tokens).

    ``generation_config`` (vLLM's ``--generation-config``): "auto" (the model's
    generation_config.json sets default sampling parameters), "vllm" (it does not), or a
    folder holding the generation_config.json to use instead.

    ``max_logprobs``: the most logprobs a request may ask for per token (vLLM's
    ``--max-logprobs``; -1: the vocabulary size).

    ``batch_invariant`` (``--batch-invariant``; vLLM's ``VLLM_BATCH_INVARIANT``): every
    token's logits bit-identical whatever the batch, the prefill chunks, the prefix cache's
    state and preemption (``pagedllm.model_executor.layers.batch_invariant``).

    ``runner_type`` (vLLM's ``--runner``, resolved): "generate" (sampling) or "pooling" (each
    prompt's hidden states pooled into one vector, ``pooler_config``: set, with every
    default resolved, on a pooling runner only; ``pagedllm.config.pooler``).
    ``convert_type`` (vLLM's ``--convert``): "embed" / "classify" serve a generative checkpoint
    as an embedder / a sequence classifier; "none" otherwise.
    """

    model: str
    model_path: Path
    tokenizer_path: Path
    hf_config: PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    seed: int
    quantization: Optional[str] = None  # --quantization: None = the checkpoint's own format
    quantization_config: Optional[dict] = None  # --quantization-config: options of a format quantized at load
    trust_remote_code: bool = False  # --trust-remote-code: config.json and tokenizer classes
    hf_overrides: Optional[dict] = None  # --hf-overrides: merged into hf_config when it was read
    generation_config: str = "auto"
    override_generation_config: Optional[dict] = None  # field -> value, over the generation config
    max_logprobs: int = 20
    batch_invariant: bool = False
    runner_type: str = "generate"
    pooler_config: Optional[PoolerConfig] = None
    convert_type: str = "none"
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)  # images: see MultiModalConfig
    load_format: str = "auto"  # --load-format: "ipc_cache" maps preloaded weights (pagedllm.preload)
    enable_sleep_mode: bool = False  # --enable-sleep-mode: sleep() / wake_up() (pagedllm.worker.sleep_mode)

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["<none>"])[0]

    @property
    def is_encoder(self) -> bool:
        """Whether the model is an encoder (``pagedllm.config.pooler.ENCODER_ARCHITECTURES``):
        bidirectional attention over the whole prompt, computed in one step."""
        return is_encoder_architecture(self.architecture)

    @property
    def is_prefix_caching_supported(self) -> bool:
        """Whether a prefix-cache hit leaves the output as it is (vLLM's rule for pooling
        models): True for a generating model; for a pooling model only with causal attention
        (not an encoder) and LAST pooling, which reads the last prompt token alone (a hit never
        covers it); MEAN and CLS read hidden states a hit would skip."""
        if self.runner_type != "pooling":
            return True
        return not self.is_encoder and self.pooler_config is not None and self.pooler_config.pooling_type == "LAST"

    @property
    def is_classifier(self) -> bool:
        """Whether the model is a sequence classifier (``pagedllm.config.pooler.is_classifier``)."""
        return is_classifier(self.architecture, self.convert_type)

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The pooling tasks the model serves (vLLM's names): a classifier "classify" and "score"
        (a cross-encoder), another pooling model "embed"; a generative model none."""
        if self.runner_type != "pooling":
            return ()
        return ("classify", "score") if self.is_classifier else ("embed",)

    @cached_property
    def pooling_activations(self) -> dict[str, str]:
        """A classifier's activation of its logits per task ("sigmoid", "softmax", "tanh" or
        "identity"): "classify" by ``classification_activation``, "score" by
        ``cross_encoder_activation`` (``pagedllm.config.pooler``); empty for other models.

        Raises:
            ValueError: a cross-encoder activation that is not built.
        """
        if not self.is_classifier:
            return {}
        model_dir = self.model_path.parent if self.model_path.is_file() else self.model_path
        return {"classify": classification_activation(self.hf_config),
                "score": cross_encoder_activation(self.hf_config, model_dir)}

    @property
    def is_matryoshka(self) -> bool:
        """Whether the model's embeddings may be cut to fewer ``dimensions`` (Matryoshka
        representation): config.json sets ``is_matryoshka`` or ``matryoshka_dimensions``, as vLLM reads it."""
        return bool(getattr(self.hf_config, "is_matryoshka", False) or self.matryoshka_dimensions)

    @property
    def matryoshka_dimensions(self) -> Optional[list[int]]:
        """The only ``dimensions`` a request may ask for (config.json's ``matryoshka_dimensions``;
        None: any up to the hidden size, when ``is_matryoshka``)."""
        return getattr(self.hf_config, "matryoshka_dimensions", None) or None

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_experts(self) -> int:
        """Routed experts of each mixture-of-experts layer (config.json's ``num_local_experts``,
        ``num_experts`` or ``n_routed_experts``, also under ``text_config``); 0 for a dense
        model (vLLM's ``ModelConfig.get_num_experts``)."""
        for config in (self.hf_config, getattr(self.hf_config, "text_config", None)):
            for key in ("num_local_experts", "num_experts", "n_routed_experts"):
                value = getattr(config, key, None) if config is not None else None
                if isinstance(value, int) and value > 0:
                    return value
        return 0

    @property
    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts layers (``num_experts`` above 0)."""
        return self.num_experts > 0

    @property
    def use_mla(self) -> bool:
        """Whether the model's attention is multi-head latent attention (DeepSeek-V2 / V3:
        a ``kv_lora_rank``; vLLM's ``ModelConfig.use_mla``): its KV cache holds one latent
        per token and layer (``num_kv_heads`` 1 of ``head_dim`` kv_lora_rank + qk_rope_head_dim)."""
        return getattr(self.hf_config, "kv_lora_rank", None) is not None

    @property
    def num_kv_heads(self) -> int:
        """KV heads of a layer's cache (all ranks): 1 with MLA (vLLM's ``get_num_kv_heads``)."""
        if self.use_mla:
            return 1
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Channels of one cached head: with MLA the latent's, kv_lora_rank + qk_rope_head_dim
        (vLLM's ``get_head_size``)."""
        if self.use_mla:
            return self.hf_config.kv_lora_rank + self.hf_config.qk_rope_head_dim
        explicit = getattr(self.hf_config, "head_dim", None)
        return explicit or self.hf_config.hidden_size // self.hf_config.num_attention_heads

    @property
    def num_kv_cache_tensors(self) -> int:
        """Tensors cached per layer and token: 2 (keys and values), 1 with MLA (the latent)."""
        return 1 if self.use_mla else 2

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def sliding_window(self) -> Optional[int]:
        """The smallest attention window of any layer in tokens (vLLM's ``get_sliding_window``);
        None: every layer attends over the whole context."""
        return min_sliding_window(self.hf_config)

    @property
    def attention_chunk_size(self) -> Optional[int]:
        """The smallest chunk of any chunked local attention layer in tokens (Llama 4's
        ``attention_chunk_size``); None: no layer attends in chunks."""
        chunks = [c for c in layer_attention_chunk_sizes(self.hf_config) if c is not None]
        return min(chunks) if chunks else None

    # ------------------------------------------------------------ generation config

    @property
    def model_dir(self) -> Path:
        """The checkpoint's folder (the folder of a single-file checkpoint)."""
        return self.model_path.parent if self.model_path.is_file() else self.model_path

    @property
    def generation_config_dir(self) -> Path:
        """The folder whose generation_config.json is read: the model's, or the one
        ``generation_config`` names."""
        if self.generation_config in GENERATION_CONFIG_MODES:
            return self.model_path.parent if self.model_path.is_file() else self.model_path
        return Path(self.generation_config).expanduser()

    def try_get_generation_config(self) -> dict[str, Any]:
        """The fields of generation_config.json that differ from transformers' defaults
        (``GenerationConfig.to_diff_dict``), read from ``generation_config_dir``; empty when
        there is none. Read for ``eos_token_id`` and the sampling defaults (as vLLM's
        ``ModelConfig.try_get_generation_config``; "vllm" still reads it, for eos ids)."""
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(self.generation_config_dir).to_diff_dict()
        except OSError:
            return {}

    def generation_config_eos_ids(self) -> set[int]:
        """The ``eos_token_id`` entries of generation_config.json (an int or a list), if any."""
        eos = self.try_get_generation_config().get("eos_token_id")
        if eos is None:
            return set()
        return {eos} if isinstance(eos, int) else set(eos)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """Default sampling parameters set by the generation config (vLLM's method and rule).

        The fields ``repetition_penalty``, ``temperature``, ``top_k``, ``top_p``, ``min_p``
        and ``max_new_tokens`` (as ``max_tokens``) that generation_config.json sets; empty
        with ``generation_config="vllm"``; ``override_generation_config`` (vLLM's
        ``--override-generation-config``) replaces any of them, whatever ``generation_config``
        is. ``do_sample`` is not read: as vLLM, a file with ``do_sample: false`` and a
        ``temperature`` samples at that temperature. The first call logs the values (vLLM's
        warning, so a user sees why outputs changed).
        """
        config = {} if self.generation_config == "vllm" else dict(self.try_get_generation_config())
        config.update(self.override_generation_config or {})
        params = {name: config[name] for name in _GENERATION_CONFIG_SAMPLING_FIELDS if config.get(name) is not None}
        if "max_new_tokens" in params:
            params["max_tokens"] = params.pop("max_new_tokens")
        key = (str(self.generation_config_dir), tuple(sorted(params.items())))
        if params and key not in _logged_generation_defaults:
            _logged_generation_defaults.add(key)
            logger.warning(
                "Default sampling parameters have been overridden by the model's Hugging Face generation "
                "config (%s): %s. Requests that do not set these fields use them; pass --generation-config "
                "vllm (offline: generation_config=\"vllm\") to use vLLM's defaults instead.",
                self.generation_config_dir / "generation_config.json", params,
            )  # fmt: skip
        return params


def derived_max_model_len(hf_config: PretrainedConfig) -> int:
    """The context length config.json allows: ``max_position_embeddings`` (2048 without it)
    scaled by the rope scaling as vLLM does (``pagedllm.arch_config.model_context_len``)."""
    return model_context_len(hf_config)


def check_generation_config(value: str) -> None:
    """``generation_config`` is "auto", "vllm", or a folder with a generation_config.json.

    Raises:
        ValueError: anything else (vLLM would silently use no defaults for such a folder).
    """
    if value in GENERATION_CONFIG_MODES:
        return
    if not (Path(value).expanduser() / "generation_config.json").is_file():
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json; "
            f"{value!r} is none of these."
        )


#: Turn ``batch_invariant`` on when set to a true word (vLLM's variable second; either one).
BATCH_INVARIANT_ENV = envs.PAGEDLLM_BATCH_INVARIANT.names


def batch_invariant_from_env() -> bool:
    """Whether one of ``BATCH_INVARIANT_ENV`` turns it on (``pagedllm.envs``' switch rule).

    Raises:
        ValueError: a value that is no switch word, naming the variable.
    """
    return envs.PAGEDLLM_BATCH_INVARIANT.get()
