"""Engine configuration: what to load, how big the cache is, how the scheduler batches.

``EngineArgs`` carries vLLM's argument names; ``EngineArgs.create_engine_config`` checks
them and resolves defaults into an ``EngineConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedllm.arch_config import check_hf_config, disable_sliding_window, min_sliding_window
from pagedllm.config.attention import AttentionConfig
from pagedllm.config.cache import SUPPORTED_BLOCK_SIZES, CacheConfig, _cpu_kvcache_space_env, cpu_max_kv_cache_tokens
from pagedllm.config.engine_config import EngineConfig
from pagedllm.config.hub import load_hf_config, resolve_model_path
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.model import (
    ModelConfig,
    batch_invariant_from_env,
    check_generation_config,
    derived_max_model_len,
    resolve_dtype,
)
from pagedllm.config.parallel import ParallelConfig, check_data_parallel_size
from pagedllm.config.scheduler import SchedulerConfig, default_max_num_batched_tokens
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.config.structured_outputs import StructuredOutputsConfig
from pagedllm.config.vllm_compat import PARTLY_BUILT_ARGS

# NOTE: torch and transformers are imported inside the functions that need them: this
# module (``EngineArgs``) is on the import path of ``pagedllm serve`` before the engine
# process is started, and that start must not wait for a 2-second torch import.



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
        check_generation_config(self.generation_config)
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
        derived, derived_from = derived_max_model_len(hf_config), "max_position_embeddings in config.json"
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
            max_kv_cache_tokens=cpu_max_kv_cache_tokens(self.max_num_seqs, max_model_len, self.enable_prefix_caching),
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
