"""Engine configuration: what to load, how big the cache is, how the scheduler batches.

``EngineArgs`` carries vLLM's argument names; ``EngineArgs.create_engine_config`` checks
them and resolves defaults into an ``EngineConfig``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from pagedllm.arch_config import check_hf_config, disable_sliding_window, min_sliding_window

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# NOTE: torch and transformers are imported inside the functions that need them: this
# module (``EngineArgs``) is on the import path of ``pagedllm serve`` before the engine
# process is started, and that start must not wait for a 2-second torch import.

logger = logging.getLogger(__name__)

SUPPORTED_BLOCK_SIZES = (8, 16, 32)

#: ``--kv-cache-dtype`` FP8 values -> torch dtype attribute names. "fp8" is e4m3, as vLLM on
#: CUDA (OCP FP8: e4m3 has 3 mantissa bits and reaches +-448; e5m2 2 bits, +-57344).
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

#: dtype names accepted by ``--dtype`` -> torch dtype attribute names.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


#: Files of a Hub repo that a model needs (weights, configs, tokenizer, chat template):
#: downloads skip everything else (other weight formats, images, training files).
HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja")


def resolve_model_path(
    model: Optional[str], revision: Optional[str] = None, download_dir: Optional[str] = None
) -> Path:
    """A local directory (or GGUF file) for ``model``: a directory, a ``.gguf`` file, or a
    Hugging Face Hub id downloaded (or found in the cache) as vLLM does.

    ``None`` means the small model that ships inside the package. A Hub id is fetched with
    ``huggingface_hub.snapshot_download`` (only ``HUB_ALLOW_PATTERNS``), at ``revision``
    (branch, tag or commit; default ``main``), into ``download_dir`` (default: the Hugging
    Face cache, ``$HF_HOME/hub``). ``huggingface_hub`` honours ``HF_TOKEN`` (gated and
    private repos), ``HF_ENDPOINT`` (a mirror) and ``HF_HUB_OFFLINE=1`` (cache only).

    Raises:
        ValueError: if ``model`` is neither a directory nor a Hub id that could be fetched;
            the message says why (not found, access denied, offline and not cached, no network).
    """
    if model is None:
        from pagedllm.model_paths import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(
            f"Model {model!r} is not a local directory with config.json and *.safetensors, nor a .gguf file."
        )
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{model!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return Path(
            snapshot_download(model, revision=revision, cache_dir=download_dir, allow_patterns=list(HUB_ALLOW_PATTERNS))
        )
    except GatedRepoError as exc:
        reason = "is gated: accept its terms on the Hub and set HF_TOKEN to a token with access"
        raise ValueError(f"Model {where} {reason}.") from exc
    except RevisionNotFoundError as exc:
        raise ValueError(f"Model {model!r} has no revision {revision!r} on {constants.ENDPOINT}.") from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(
            f"Model {model!r} is not a local directory, and {constants.ENDPOINT} has no such model "
            "(or it is private: set HF_TOKEN)."
        ) from exc
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else f"{constants.ENDPOINT} could not be reached"
        raise ValueError(
            f"Model {where} is not a local directory and not in the Hugging Face cache "
            f"({download_dir or constants.HF_HUB_CACHE}), and {why}."
        ) from exc
    except HfHubHTTPError as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"Model {where} could not be downloaded from {constants.ENDPOINT}: {first_line}") from exc


def load_hf_config(model_path: Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The model's Hugging Face config: config.json of a directory, or, for a ``.gguf`` file,
    the one transformers builds from the file's metadata (architecture and hyper-parameters;
    ``architectures`` filled in from the model type when the file does not name it).

    Raises:
        ValueError: no readable config (transformers' message).
    """
    from transformers import AutoConfig

    try:
        if model_path.suffix != ".gguf":
            return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        hf_config = AutoConfig.from_pretrained(model_path.parent, gguf_file=model_path.name)
    except (OSError, ValueError) as exc:
        raise ValueError(f"Cannot read the model config of {model_path}: {exc}") from exc
    if not getattr(hf_config, "architectures", None):
        hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type, hf_config.model_type)]
    return hf_config


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
            return getattr(torch, _DTYPES[str(dtype)])
        except KeyError:
            raise ValueError(f"Unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}.") from None
    # NOTE: transformers >= 4.56 names it ``dtype`` and warns on every ``torch_dtype`` read.
    if hasattr(hf_config, "dtype"):
        config_dtype = hf_config.dtype
    else:
        config_dtype = getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, _DTYPES.get(config_dtype, "float32"))
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


@dataclass
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
    generation_config: str = "auto"
    override_generation_config: Optional[dict] = None  # field -> value, over the generation config
    max_logprobs: int = 20
    batch_invariant: bool = False

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["<none>"])[0]

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        explicit = getattr(self.hf_config, "head_dim", None)
        return explicit or self.hf_config.hidden_size // self.hf_config.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def sliding_window(self) -> Optional[int]:
        """The smallest attention window of any layer in tokens (vLLM's ``get_sliding_window``);
        None: every layer attends over the whole context."""
        return min_sliding_window(self.hf_config)

    # ------------------------------------------------------------ generation config

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


@dataclass
class CacheConfig:
    """The paged KV cache: block size (tokens), memory budget (bytes), prefix caching.

    ``kv_cache_memory_bytes`` is an exact budget, from ``kv_cache_memory_source`` (the
    argument, or ``PAGEDLLM_CPU_KVCACHE_SPACE`` / ``VLLM_CPU_KVCACHE_SPACE`` in GiB on CPU).
    Without it the budget is what ``gpu_memory_utilization`` leaves, and on CPU at most
    ``max_kv_cache_tokens`` tokens: what the configuration can use at once.
    ``num_gpu_blocks_override`` (vLLM's) sets the number of blocks exactly, with no sizing.
    """

    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: Optional[int]
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    num_gpu_blocks: Optional[int] = None  # set once the budget is measured
    kv_cache_memory_source: str = "kv_cache_memory_bytes"
    max_kv_cache_tokens: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None
    #: vLLM's ``--kv-cache-dtype``: "auto" (the model's dtype) or a key of ``KV_CACHE_DTYPES``.
    cache_dtype: str = "auto"
    #: vLLM's ``--calculate-kv-scales``: FP8 scales from the first batch (``pagedllm.attention.kv_cache_quant``).
    calculate_kv_scales: bool = False

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache's element type: ``model_dtype`` for "auto", else the FP8 type of
        ``KV_CACHE_DTYPES`` (1 byte per element)."""
        if self.cache_dtype == "auto":
            return model_dtype
        import torch

        return getattr(torch, KV_CACHE_DTYPES[self.cache_dtype])

    def cache_dtype_name(self, model_dtype: torch.dtype) -> str:
        """The cache's dtype as the start-up log and ``/metrics`` name it: the model's dtype
        for "auto" (e.g. "bfloat16"), else "fp8_e4m3" / "fp8_e5m2" ("fp8" is e4m3)."""
        if self.cache_dtype == "auto":
            return str(model_dtype).removeprefix("torch.")
        return "fp8_e5m2" if self.cache_dtype == "fp8_e5m2" else "fp8_e4m3"


@dataclass
class SchedulerConfig:
    """Batching limits: requests per step, tokens per step, context length (tokens)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class ParallelConfig:
    """How the model spreads over devices: parallel sizes and the executor.

    ``data_parallel_size`` counts engine replicas (vLLM's); it is not part of ``world_size``:
    each replica runs ``world_size`` workers of its own (``-dp 2 -tp 2``: 4 worker processes).
    ``data_parallel_rank``: the replica this configuration belongs to (set by the replica's
    engine process; its workers take the machine's units ``data_parallel_rank x world_size``
    onwards: see ``local_rank_offset``).

    ``distributed_executor_backend``: ``"uni"`` (one worker in the engine's process),
    ``"mp"`` (one worker process per rank), ``"ray"`` (one Ray actor per rank, on the nodes
    of a Ray cluster), an ``Executor`` subclass, or None: ``"uni"`` for a world size of 1,
    else ``"ray"`` when this process is connected to Ray (or, on GPUs, for more ranks than
    the machine's devices) and ``"mp"`` otherwise (see ``Executor.get_class``).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: Union[str, type, None] = None
    data_parallel_size: int = 1
    data_parallel_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_world_size(self) -> int:
        """Worker processes on this machine over all data-parallel replicas (one machine
        hosts all of them: ``data_parallel_size x world_size``)."""
        return self.data_parallel_size * self.world_size

    @property
    def local_rank_offset(self) -> int:
        """The machine-local rank of this replica's first worker: its workers are local
        ranks ``offset .. offset + world_size - 1`` of ``local_world_size`` (their cores on
        CPU, their devices on CUDA: ``Platform.bind_worker``)."""
        return self.data_parallel_rank * self.world_size

    @property
    def output_rank(self) -> int:
        """The global rank whose worker returns each step's ``ModelRunnerOutput``: tensor
        rank 0 of the last pipeline stage (rank 0 without pipeline parallelism)."""
        return self.world_size - self.tensor_parallel_size

    def verify_with_model_config(self, model_config: ModelConfig) -> None:
        """Check that the model splits over ``tensor_parallel_size`` ranks: the query heads
        and the vocabulary (no padding) by it, and KV heads by it or it by them (each KV
        head then held by ``tp / num_kv_heads`` ranks, as vLLM); that each of the
        ``pipeline_parallel_size`` stages gets at least one layer; and that data-parallel
        replicas with several workers each use the multiprocess executor (their workers are
        placed on this machine).

        Raises:
            ValueError: naming the sizes that do not divide, more stages than layers, or
                replicas of several workers on Ray.
        """
        tp = self.tensor_parallel_size
        if tp < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size ({tp}) and pipeline_parallel_size ({self.pipeline_parallel_size}) must be at least 1."
            )
        if self.data_parallel_size > 1 and self.world_size > 1 and self.distributed_executor_backend == "ray":
            raise ValueError(
                f"data_parallel_size {self.data_parallel_size} with the Ray executor is not supported yet "
                f"(replicas place their workers on this machine); use distributed_executor_backend 'mp'."
            )
        hf = model_config.hf_config
        num_heads, num_kv_heads, vocab = hf.num_attention_heads, model_config.num_kv_heads, model_config.vocab_size
        if num_heads % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} does not divide the model's num_attention_heads {num_heads}."
            )
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {tp} and the model's num_key_value_heads {num_kv_heads}: neither divides "
                f"the other."
            )
        if vocab % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's vocab_size {vocab}.")
        if self.pipeline_parallel_size > model_config.num_layers:
            raise ValueError(
                f"pipeline_parallel_size {self.pipeline_parallel_size} exceeds the model's num_hidden_layers "
                f"{model_config.num_layers}: every stage needs at least one layer."
            )


@dataclass
class AttentionConfig:
    """The attention backend by name (``--attention-backend``); None: ``$PAGEDLLM_ATTENTION_BACKEND``,
    else chosen by platform (``pagedllm.attention.selector``, which checks the name at start-up)."""

    backend: Optional[str] = None


# ---------------------------------------------------------------- speculative decoding

#: ``speculative_config["method"]`` values built here (vLLM's names).
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
#: vLLM's methods that are not built yet.
_SPECULATIVE_METHODS_NOT_BUILT = ("medusa", "mlp_speculator", "suffix", "mtp")
_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "enable_adaptive_k", "adaptive_k_ema_alpha")
#: EAGLE methods -> (architectures a head's config.json may name, the head class loaded;
#: vLLM's names, ``pagedllm.model_executor.models.llama_eagle``).
EAGLE_HEAD_ARCHITECTURES = {
    "eagle": (("LlamaForCausalLM", "EagleLlamaForCausalLM"), "EagleLlamaForCausalLM"),
    "eagle3": (("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"), "Eagle3LlamaForCausalLM"),
}


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` / ``speculative_config``).

    ``method``: ``"ngram"`` (prompt lookup over the request's own prompt and output,
    ``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens long), ``"draft_model"`` (a
    smaller model with the target's vocabulary, at ``model``; implied when only ``model``
    is given, as vLLM), or ``"eagle"`` / ``"eagle3"`` (an EAGLE / EAGLE-3 head at
    ``model``, which reads the target's hidden states: Li et al. 2024, 2025).
    ``num_speculative_tokens`` (k) tokens are proposed per request and step, and verified
    by the target in one forward pass. ``draft_model_config`` is the draft's or head's
    ``ModelConfig`` (None for n-gram), and ``eagle_aux_hidden_state_layer_ids`` the
    target layers whose input an EAGLE-3 head reads, both set by
    ``EngineArgs.create_engine_config``.

    ``enable_adaptive_k`` (the key of vLLM's Adaptive K, which is off by default there; on
    here): ``num_speculative_tokens`` is the most drafts per request and step, and each
    request proposes 0 .. k of them as its measured acceptance and the measured cost of
    drafting make worthwhile (``pagedllm.core.spec_length``), ``adaptive_k_ema_alpha``
    weighting its newest step (vLLM's default 0.3). Off: always k.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None
    draft_model_config: Optional[ModelConfig] = None
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] = ()
    enable_adaptive_k: bool = True
    adaptive_k_ema_alpha: float = 0.3

    @property
    def prior_draft_token_cost(self) -> float:
        """One draft token's cost relative to a plain step's share per request, assumed
        until measured: a verified row (n-gram proposals are free), plus a draft forward."""
        return 0.02 if self.method == "ngram" else 0.1

    @property
    def uses_draft_model(self) -> bool:
        """Whether a model proposes (a draft model or an EAGLE head), with its own paged KV cache."""
        return self.method != "ngram"

    @property
    def is_eagle(self) -> bool:
        return self.method in EAGLE_HEAD_ARCHITECTURES

    @classmethod
    def from_dict(cls, config: dict) -> "SpeculativeConfig":
        """Check the keys and values of a ``speculative_config`` dict (no model is read).

        n-gram lookup lengths default as in vLLM: both 5 when neither is given, else the
        missing one equals the other.

        Raises:
            ValueError: "speculative_config[KEY] ...": an unknown key, a missing or unknown
                ``method``, ``num_speculative_tokens`` missing or below 1, lookup lengths
                below 1 or min > max, ``model`` missing for a draft model or EAGLE head,
                ``enable_adaptive_k`` not a bool, ``adaptive_k_ema_alpha`` outside (0, 1].
        """
        unknown = sorted(set(config) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config[{unknown[0]!r}] is not a known key; known: {', '.join(_SPECULATIVE_KEYS)}.")
        method = config.get("method") or ("draft_model" if config.get("model") else None)
        if method in _SPECULATIVE_METHODS_NOT_BUILT:
            raise ValueError(f"speculative_config['method']={method!r} is not supported yet; supported: {', '.join(SPECULATIVE_METHODS)}.")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {', '.join(SPECULATIVE_METHODS)} "
                             f"(or give 'model' for a draft model), got {method!r}.")
        k = config.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config['num_speculative_tokens'] must be an integer >= 1, got {k!r}.")
        if method != "ngram" and not config.get("model"):
            what = "an EAGLE head's" if method in EAGLE_HEAD_ARCHITECTURES else "the draft model's"
            raise ValueError(f"speculative_config['model'] ({what} path or Hub id) is required for method {method!r}.")
        lookup_min, lookup_max = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if method == "ngram":
            lookup_min = lookup_min if lookup_min is not None else (lookup_max if lookup_max is not None else 5)
            lookup_max = lookup_max if lookup_max is not None else lookup_min
            for key, value in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"speculative_config[{key!r}] must be an integer >= 1, got {value!r}.")
            if lookup_min > lookup_max:
                raise ValueError(f"speculative_config['prompt_lookup_min'] ({lookup_min}) must not exceed "
                                 f"'prompt_lookup_max' ({lookup_max}).")
        adaptive, ema_alpha = config.get("enable_adaptive_k", True), config.get("adaptive_k_ema_alpha", 0.3)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config['enable_adaptive_k'] must be true or false, got {adaptive!r}.")
        if isinstance(ema_alpha, bool) or not isinstance(ema_alpha, (int, float)) or not 0 < ema_alpha <= 1:
            raise ValueError(f"speculative_config['adaptive_k_ema_alpha'] must be a number in (0, 1], got {ema_alpha!r}.")
        return cls(method, k, lookup_min, lookup_max, config.get("model"),
                   enable_adaptive_k=adaptive, adaptive_k_ema_alpha=float(ema_alpha))

    def resolve_draft_model(self, target: ModelConfig, revision: Optional[str], download_dir: Optional[str]) -> None:
        """Read the draft model's or EAGLE head's config.json into ``draft_model_config``
        (not for n-gram): the target's dtype and context length.

        Raises:
            ValueError: naming ``speculative_config['model']``: a path that is not a model, a
                vocabulary size other than the target's, or a context shorter than the
                target's ``max_model_len``; for an EAGLE head also an architecture of the
                other method, a hidden size other than the target's, or EAGLE-3 layer ids
                outside the target (see ``_check_eagle_head``).
        """
        if not self.uses_draft_model:
            return
        try:
            path = resolve_model_path(self.model, revision, download_dir)
            hf_config = load_hf_config(path, target.trust_remote_code)
        except (ValueError, OSError) as e:
            raise ValueError(f"speculative_config['model']={self.model!r}: {e}") from e
        if hf_config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config['model']={self.model!r} has a vocabulary of {hf_config.vocab_size} "
                             f"tokens, the target model {target.vocab_size}: a draft model must share the target's vocabulary.")
        if _derived_max_model_len(hf_config) < target.max_model_len:
            raise ValueError(f"speculative_config['model']={self.model!r} handles {_derived_max_model_len(hf_config)} "
                             f"tokens of context, fewer than max_model_len ({target.max_model_len}).")
        if self.is_eagle:
            self._check_eagle_head(hf_config, target)
        self.draft_model_config = ModelConfig(
            model=str(self.model), model_path=path, tokenizer_path=target.tokenizer_path, hf_config=hf_config,
            dtype=target.dtype, max_model_len=target.max_model_len, seed=target.seed,
            trust_remote_code=target.trust_remote_code,
        )  # fmt: skip

    def _check_eagle_head(self, hf_config: PretrainedConfig, target: ModelConfig) -> None:
        """Check an EAGLE head against its target; name its class (vLLM's architecture
        name) in ``hf_config.architectures``; resolve the EAGLE-3 layer ids: the config's
        ``eagle_aux_hidden_state_layer_ids``, else vLLM's default (2, L // 2, L - 3) for a
        target of L layers; id i is the residual stream entering target layer i.

        Raises:
            ValueError: naming ``speculative_config['model']``: see ``resolve_draft_model``.
        """
        accepted, head_class = EAGLE_HEAD_ARCHITECTURES[self.method]
        name = f"speculative_config['model']={self.model!r}"
        architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
        if architecture not in accepted:
            raise ValueError(f"{name} is a {architecture} checkpoint; method {self.method!r} loads "
                             f"{' or '.join(accepted)} heads.")
        target_hidden = target.hf_config.hidden_size
        for key in ("hidden_size", "target_hidden_size"):
            size = getattr(hf_config, key, None)
            if size is not None and size != target_hidden:
                raise ValueError(f"{name} has {key} {size}, the target model {target_hidden}: an EAGLE head "
                                 "reads the target's hidden states and shares its embeddings.")
        hf_config.architectures = [head_class]
        if self.method != "eagle3":
            return
        num_layers = target.num_layers
        ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) or (2, num_layers // 2, num_layers - 3)
        if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
            raise ValueError(f"{name}: eagle_aux_hidden_state_layer_ids {list(ids)} must be 3 layer ids of the "
                             f"target's {num_layers} layers (0 .. {num_layers - 1}); the default is (2, L // 2, L - 3).")
        self.eagle_aux_hidden_state_layer_ids = tuple(ids)


#: ``StructuredOutputsConfig.backend`` values: vLLM's names of the backends built here.
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass
class StructuredOutputsConfig:
    """Constrained decoding options of the engine (vLLM's ``--structured-outputs-config``).

    Attributes:
        backend: "xgrammar", "guidance" (llguidance), or "auto": xgrammar, and llguidance
            for a constraint xgrammar cannot compile or enforce.
        disable_fallback: with "auto", never fall back to llguidance.
        disable_any_whitespace: JSON output without whitespace between tokens.
        disable_additional_properties: JSON objects whose schema has no
            ``additionalProperties`` take no extra keys (llguidance; xgrammar always does so).
        max_whitespace_cnt: the most whitespace characters JSON output may have between
            two tokens (xgrammar's option of that name; llguidance: a whitespace pattern).
        max_number_digits: the most digits of the integer part of a JSON-schema integer
            or number without a ``maximum`` (or ``minimum``): the missing bound becomes
            +-(10**digits - 1), so the backends also cap its fraction and drop exponents.
        max_string_length: the ``maxLength`` of a JSON-schema string without one (nor a
            ``pattern``, ``format``, ``enum`` or ``const``); with xgrammar, of every string
            its grammar leaves unbounded (object keys of free-form objects too).

    The last three are pagedllm's: a small model left unbounded can fill ``max_tokens``
    with newlines, digits or one endless string; None lifts a bound (vLLM's behaviour).
    Strings default to 1024 characters, long for a JSON field and short enough that a
    runaway one ends within a few hundred tokens; the bound costs xgrammar a few ms a token
    inside a string.

    Raises:
        ValueError: an unknown backend, a bound below 1, or an unknown key in ``from_dict``.
    """

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    max_whitespace_cnt: Optional[int] = 2
    max_number_digits: Optional[int] = 15
    max_string_length: Optional[int] = 1024

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured outputs backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                f"got {self.backend!r}."
            )
        for name in ("max_whitespace_cnt", "max_number_digits", "max_string_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"structured outputs {name} must be a positive integer or null, got {value!r}.")

    @classmethod
    def from_dict(cls, value: "Optional[dict | StructuredOutputsConfig]") -> "StructuredOutputsConfig":
        """The config of ``--structured-outputs-config``'s JSON object (None: defaults)."""
        if isinstance(value, cls):
            return value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value or {}) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs_config has unknown keys {unknown}; known: {', '.join(sorted(known))}."
            )
        return cls(**(value or {}))


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (``--enable-lora``; vLLM's ``LoRAConfig`` names and defaults):
    ``max_loras`` adapters in one step (device slots), ``max_lora_rank`` the largest rank,
    ``max_cpu_loras`` adapters kept loaded in CPU memory (LRU; None: ``max_loras``).

    Raises:
        ValueError: a value below 1, or ``max_cpu_loras`` < ``max_loras`` (vLLM's rule).
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    attention_config: AttentionConfig = field(default_factory=AttentionConfig)
    lora_config: Optional[LoRAConfig] = None  # None: LoRA off (no --enable-lora)
    speculative_config: Optional[SpeculativeConfig] = None
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)


def _derived_max_model_len(hf_config: PretrainedConfig) -> int:
    return int(getattr(hf_config, "max_position_embeddings", 2048))


#: Default ``max_num_batched_tokens`` by (device type, usage context): vLLM's defaults
#: (``EngineArgs._set_default_args`` in vLLM 0.32).
_DEFAULT_MAX_NUM_BATCHED_TOKENS = {
    ("cpu", "llm"): 4096,
    ("cpu", "api_server"): 2048,
    ("cuda", "llm"): 16384,
    ("cuda", "api_server"): 8192,
}


def default_max_num_batched_tokens(usage_context: str) -> int:
    """The step token budget used when none is given (see ``EngineArgs``).

    Raises:
        ValueError: for a usage context other than "llm" or "api_server".
    """
    from pagedllm.platforms import current_platform

    try:
        return _DEFAULT_MAX_NUM_BATCHED_TOKENS[(current_platform.device_type, usage_context)]
    except KeyError:
        raise ValueError(f"usage_context must be 'llm' or 'api_server', got {usage_context!r}.") from None


#: Environment variables giving the CPU KV-cache size in GiB (vLLM-CPU's is the second).
CPU_KVCACHE_SPACE_ENV_VARS = ("PAGEDLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")


def _cpu_kvcache_space_env() -> tuple[Optional[int], str]:
    """(bytes, source) from the first of ``CPU_KVCACHE_SPACE_ENV_VARS`` set to a positive
    number of GiB on CPU, else ``(None, "")``. 0 means unset, as in vLLM-CPU.

    Raises:
        ValueError: a value that is not a number.
    """
    import os

    from pagedllm.platforms import current_platform

    if not current_platform.is_cpu:
        return None, ""
    for name in CPU_KVCACHE_SPACE_ENV_VARS:
        value = os.environ.get(name, "").strip()
        if not value:
            continue
        try:
            gib = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number of GiB, got {value!r}.") from None
        if gib > 0:
            return int(gib * 2**30), f"{name}={value} GiB"
    return None, ""


def _cpu_max_kv_cache_tokens(max_num_seqs: int, max_model_len: int, enable_prefix_caching: bool) -> Optional[int]:
    """On CPU, the most KV-cache tokens the configuration can use: ``max_num_seqs`` sequences
    of ``max_model_len`` tokens, twice that with prefix caching (finished requests' blocks
    stay cached while as many again run). None on GPU, where vLLM fills the device."""
    from pagedllm.platforms import current_platform

    if not current_platform.is_cpu:
        return None
    return max_num_seqs * max_model_len * (2 if enable_prefix_caching else 1)


def _check_generation_config(value: str) -> None:
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


#: vLLM engine arguments accepted with only some of vLLM's values: argument -> (the values
#: built here, why). ``EngineArgs`` refuses any other value at once: "... is not supported yet".
PARTLY_BUILT_ARGS: dict[str, tuple[tuple, str]] = {
    "distributed_executor_backend": ((None, "uni", "mp", "ray"), "pagedllm starts its own workers"),
    "load_format": (("auto", "safetensors", "gguf"), "pagedllm loads *.safetensors checkpoints and .gguf files"),
    "kv_cache_dtype": (("auto", *KV_CACHE_DTYPES), "the KV cache has the model's dtype or an FP8 type"),
    "tokenizer_mode": (("auto", "hf"), "pagedllm loads Hugging Face fast tokenizers"),
    "enable_chunked_prefill": ((None, True), "pagedllm always cuts long prompts into chunks"),
    "cpu_offload_gb": ((0,), "weights stay on the device"),
}


def check_data_parallel_size(data_parallel_size: int, usage_context: str) -> None:
    """``data_parallel_size``: engine replicas behind one API server (``pagedllm serve -dp N``,
    vLLM's internal load balancing; see ``pagedllm.engine.dp_client``). Offline (``LLM``), vLLM
    runs one engine per process and leaves launching the ranks to the user; pagedllm refuses it.

    Raises:
        ValueError: a size below 1, or above 1 outside the API server (``usage_context`` "llm").
    """
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}.")
    if data_parallel_size > 1 and usage_context != "api_server":
        raise ValueError(
            f"data_parallel_size={data_parallel_size} is not supported yet offline (LLM runs one engine core); "
            f"serve the replicas behind one API server: pagedllm serve MODEL -dp {data_parallel_size}."
        )


#: Turn ``batch_invariant`` on when set to 1 / true (vLLM's variable second; either one).
BATCH_INVARIANT_ENV = ("PAGEDLLM_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT")


def batch_invariant_from_env() -> bool:
    """Whether one of ``BATCH_INVARIANT_ENV`` is set to 1 / true / yes."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in BATCH_INVARIANT_ENV)


@dataclass
class EngineArgs:
    """Arguments of ``LLM`` / ``LLMEngine`` / ``pagedllm serve``, with vLLM's names and defaults.

    ``max_num_batched_tokens`` defaults as in vLLM, by device and use (``usage_context``:
    ``"llm"`` for ``LLM`` / offline, ``"api_server"`` for ``pagedllm serve``): 4096 / 2048
    tokens on CPU, 16384 / 8192 on GPU, and never below ``max_num_seqs``. The server's
    smaller step lets waiting requests start sooner while others decode (time to first
    token); offline, fewer larger steps cost less. ``gpu_memory_utilization``
    is the fraction of the device memory (on CPU: of the RAM available at start-up) that
    weights, activations and KV cache may use together; ``kv_cache_memory_bytes`` overrides
    it with an exact KV-cache size in bytes. ``attention_backend`` names the attention
    backend (e.g. ``"TORCH_SDPA"``); None chooses by platform. ``generation_config``: see
    ``ModelConfig`` (default "auto", as vLLM).

    vLLM's other common arguments are accepted with vLLM's names and defaults, in three
    kinds: partly built (``PARTLY_BUILT_ARGS``: e.g. ``pipeline_parallel_size`` 1 only; another
    value raises ``ValueError`` "... is not supported yet" when ``EngineArgs`` is built);
    built (``enable_lora``, ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``: multi-LoRA
    serving, see ``LoRAConfig``; ``trust_remote_code``: passed to transformers when reading config.json;
    ``max_logprobs``: the most logprobs per token a request may ask for, 20, -1 for the
    vocabulary size; ``batch_invariant``: logprobs bit-identical whatever the batch, see
    ``ModelConfig`` (unquantized models, no LoRA, no speculative decoding; also turned on by
    ``BATCH_INVARIANT_ENV``, as vLLM's ``VLLM_BATCH_INVARIANT=1``); ``num_gpu_blocks_override``: the exact number of KV-cache blocks;
    ``kv_cache_dtype`` "fp8" / "fp8_e4m3" / "fp8_e5m2" and ``calculate_kv_scales``: an FP8
    KV cache, see ``CacheConfig``);
    and no-ops, that cannot matter here (``enforce_eager``, ``max_seq_len_to_capture``:
    no CUDA graphs; ``swap_space``: preempted requests are recomputed, never swapped;
    ``disable_custom_all_reduce``: no custom CUDA all-reduce exists).

    ``disable_sliding_window`` (vLLM's): layers with a sliding window (Mistral's
    ``sliding_window``, Qwen2's "sliding_attention" ``layer_types``) attend over the whole
    context instead, and ``max_model_len`` is capped at the smallest window (up to which
    the model's output is unchanged); a larger ``max_model_len`` raises ``ValueError``. No
    effect on a model without windows. Without it, windows are served as the model defines
    them (``pagedllm.arch_config.layer_sliding_windows``).

    ``speculative_config``: vLLM's dict, checked by ``SpeculativeConfig.from_dict``.

    Raises (constructor):
        ValueError: a value of ``PARTLY_BUILT_ARGS`` that is not built; ``max_logprobs`` < -1;
            a bad ``speculative_config`` (the message names the key); a bad
            ``structured_outputs_config``.
    """

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    revision: Optional[str] = None
    tokenizer_revision: Optional[str] = None
    download_dir: Optional[str] = None
    dtype: Any = "auto"
    max_model_len: Optional[int] = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    attention_backend: Optional[str] = None
    generation_config: str = "auto"
    override_generation_config: Optional[dict] = None  # field -> value, over the generation config
    usage_context: str = "llm"
    quantization: Optional[str] = None
    #: vLLM's ``quantization_config``: options of an online ``quantization`` (int4: ``{"group_size": 128}``).
    quantization_config: Optional[dict] = None
    #: vLLM's ``disable_log_stats``: no periodic stats line (``pagedllm.metrics.loggers``);
    #: ``LLM`` sets it by default, as vLLM's.
    disable_log_stats: bool = False
    distributed_executor_backend: Union[str, type, None] = None
    # vLLM's other engine arguments (names and defaults as vLLM's ``EngineArgs``).
    # Partly built ones: see ``PARTLY_BUILT_ARGS``.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    load_format: str = "auto"
    kv_cache_dtype: str = "auto"  # see CacheConfig.cache_dtype
    calculate_kv_scales: bool = False  # see CacheConfig.calculate_kv_scales
    tokenizer_mode: str = "auto"
    enable_chunked_prefill: Optional[bool] = None
    cpu_offload_gb: float = 0
    #: vLLM's ``structured_outputs_config`` (see ``StructuredOutputsConfig``): a dict or the config.
    structured_outputs_config: Any = None
    # Built: they act as in vLLM.
    speculative_config: Optional[dict] = None  # see ``SpeculativeConfig``
    enable_lora: bool = False  # multi-LoRA serving: see ``LoRAConfig``
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    trust_remote_code: bool = False
    max_logprobs: int = 20
    batch_invariant: bool = False
    num_gpu_blocks_override: Optional[int] = None
    #: Full attention in every layer, ``max_model_len`` capped at the sliding window (vLLM's).
    disable_sliding_window: bool = False
    # No-ops here (CUDA graphs, swapping and custom all-reduce do not exist in pagedllm):
    # accepted so vLLM launch lines run.
    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192
    swap_space: float = 4
    disable_custom_all_reduce: bool = False

    def __post_init__(self) -> None:
        """Refuse at once a value asking for something not built (``PARTLY_BUILT_ARGS``),
        a ``max_logprobs`` below -1, and bad LoRA limits (``LoRAConfig``).

        Raises:
            ValueError: "``name=value`` is not supported yet (why); supported: ...".
        """
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        self.batch_invariant = self.batch_invariant or batch_invariant_from_env()
        if self.batch_invariant and (self.enable_lora or self.speculative_config is not None):
            raise ValueError(
                "batch_invariant is not supported yet with enable_lora or speculative_config "
                "(their kernels are not batch-invariant)."
            )
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary size) or more, got {self.max_logprobs}.")
        if self.enable_lora:
            LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)  # checks the values
        StructuredOutputsConfig.from_dict(self.structured_outputs_config)
        check_data_parallel_size(self.data_parallel_size, self.usage_context)
        for name, (supported, why) in PARTLY_BUILT_ARGS.items():
            value = getattr(self, name)
            if isinstance(value, type):  # an Executor subclass as distributed_executor_backend
                continue
            if value not in supported:
                allowed = ", ".join(repr(v) for v in supported)
                raise ValueError(f"{name}={value!r} is not supported yet ({why}); supported: {allowed}.")

    def create_engine_config(self, log_choices: bool = True) -> EngineConfig:
        """Check the arguments and resolve defaults; ``log_choices``: log what "auto" values
        resolved to (INFO). An engine process that resolves the arguments its front end
        resolves too passes False, so that each choice is logged once.

        Raises:
            ValueError: naming the bad argument and its allowed values.
        """
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        _check_generation_config(self.generation_config)
        from pagedllm.kernels import isa

        isa.selected_isa()  # a bad PAGEDLLM_CPU_ISA fails here, before anything is loaded
        model_path = resolve_model_path(self.model, self.revision, self.download_dir)
        tokenizer_path = (
            resolve_model_path(self.tokenizer, self.tokenizer_revision, self.download_dir)
            if self.tokenizer
            else model_path
        )
        hf_config = load_hf_config(model_path, self.trust_remote_code)
        check_hf_config(hf_config)
        derived, derived_from = _derived_max_model_len(hf_config), "max_position_embeddings in config.json"
        window = min_sliding_window(hf_config)
        if self.disable_sliding_window and window is not None:
            # vLLM's rule: full attention computes what the model does only up to its window.
            if window < derived:
                derived, derived_from = window, "the sliding window, as --disable-sliding-window caps it"
            disable_sliding_window(hf_config)
        max_model_len = self.max_model_len or derived
        if max_model_len > derived:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's maximum context "
                f"length ({derived}, {derived_from})."
            )
        max_num_batched_tokens = self.max_num_batched_tokens or max(
            default_max_num_batched_tokens(self.usage_context), self.max_num_seqs
        )
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}.")
        model_config = ModelConfig(
            model=str(self.model or model_path.name),
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, hf_config, log=log_choices),
            max_model_len=max_model_len,
            seed=self.seed,
            quantization=self.quantization,
            quantization_config=self.quantization_config,
            trust_remote_code=self.trust_remote_code,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
            max_logprobs=self.max_logprobs,
            batch_invariant=self.batch_invariant,
        )
        self._check_num_gpu_blocks_override(max_model_len)
        kv_cache_memory_bytes, source = self.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        if kv_cache_memory_bytes is None:
            kv_cache_memory_bytes, source = _cpu_kvcache_space_env()
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            kv_cache_memory_source=source,
            max_kv_cache_tokens=_cpu_max_kv_cache_tokens(self.max_num_seqs, max_model_len, self.enable_prefix_caching),
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            data_parallel_size=self.data_parallel_size,
        )
        parallel_config.verify_with_model_config(model_config)
        if self.speculative_config is not None and parallel_config.pipeline_parallel_size > 1:
            raise ValueError(
                f"speculative_config with pipeline_parallel_size {self.pipeline_parallel_size} is not supported yet "
                f"(drafts are verified on the last stage only); use pipeline_parallel_size 1."
            )
        attention_config = AttentionConfig(self.attention_backend)
        lora_config = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None
        speculative_config = None
        if self.speculative_config is not None:
            speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            speculative_config.resolve_draft_model(model_config, None, self.download_dir)
        return EngineConfig(model_config, cache_config, scheduler_config, parallel_config, attention_config,
                            lora_config=lora_config, speculative_config=speculative_config,
                            structured_outputs_config=StructuredOutputsConfig.from_dict(self.structured_outputs_config))

    def _check_num_gpu_blocks_override(self, max_model_len: int) -> None:
        """``num_gpu_blocks_override`` (None, or blocks enough for one ``max_model_len`` sequence).

        Raises:
            ValueError: a number of blocks that cannot hold one sequence.
        """
        if self.num_gpu_blocks_override is None:
            return
        blocks_per_seq = -(-max_model_len // self.block_size)
        if self.num_gpu_blocks_override < blocks_per_seq:
            raise ValueError(
                f"num_gpu_blocks_override={self.num_gpu_blocks_override} cannot hold one sequence of "
                f"max_model_len {max_model_len} tokens: that needs {blocks_per_seq} blocks of {self.block_size} tokens."
            )
