"""Engine configuration: what to load, how big the cache is, how the scheduler batches.

``EngineArgs`` carries vLLM's argument names; ``EngineArgs.create_engine_config`` checks
them and resolves defaults into an ``EngineConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import argparse
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

from pagedllm.arch_config import BIDIRECTIONAL_IMAGE_ARCHITECTURES, check_hf_config
from pagedllm.arch_config import disable_sliding_window, min_sliding_window
from pagedllm.config.arg_types import (
    compilation_config_type,
    fraction_type,
    human_readable_int,
    int_type,
    json_object,
    json_object_type,
    max_model_len_type,
    non_negative_float,
    positive_float,
    positive_int,
)
from pagedllm.config.attention import AttentionConfig
from pagedllm.config.cache import SUPPORTED_BLOCK_SIZES, CacheConfig
from pagedllm.config.engine_config import EngineConfig
from pagedllm.config.flags import FLAG, add_flags, flag_field, flag_values, given_flag_values, not_a_flag
from pagedllm.config.hub import load_hf_config, resolve_model_path
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.multimodal import MultiModalConfig
from pagedllm.config.observability import ObservabilityConfig, detailed_traces_type
from pagedllm.config.model import (
    DTYPES,
    ModelConfig,
    batch_invariant_from_env,
    check_generation_config,
    derived_max_model_len,
    resolve_dtype,
)
from pagedllm.config.parallel import ParallelConfig, check_data_parallel_size
from pagedllm.config.pooler import (
    CONVERT_TYPES,
    RUNNER_TYPES,
    PoolerConfig,
    default_pooler_config,
    encoder_context_len,
    is_classifier,
    is_encoder_architecture,
    resolve_runner,
    runner_and_convert,
    set_classifier_from_token,
)
from pagedllm.config.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from pagedllm.config.kv_transfer import KVTransferConfig
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.config.structured_outputs import StructuredOutputsConfig
from pagedllm.config.vllm_compat import PARTLY_BUILT_ARGS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# NOTE: torch and transformers are imported inside the functions that need them: this
# module (``EngineArgs``) is on the import path of ``pagedllm serve`` before the engine
# process is started, and that start must not wait for a 2-second torch import.

#: Flag types of sizes ("32k", "4G") that an offline keyword may also give as such a string.
_SIZE_TYPES = (human_readable_int, max_model_len_type)



@dataclass
class EngineArgs:
    """Arguments of ``LLM`` / ``LLMEngine`` / ``pagedllm serve``, with vLLM's names and defaults.

    Each field declares its command-line flag (``flag_field``: help, type, choices,
    aliases; ``--max-model-len`` for ``max_model_len``) or says why it has none
    (``not_a_flag``); ``add_engine_args`` adds them to a parser and ``from_cli_args``
    reads them back.

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
    and no-ops, that cannot matter here (``enforce_eager``, ``max_seq_len_to_capture``,
    ``compilation_config``: no torch.compile, no CUDA graphs; ``swap_space``: preempted requests are recomputed, never swapped;
    ``disable_custom_all_reduce``: no custom CUDA all-reduce exists).

    ``disable_sliding_window`` (vLLM's): layers with a sliding window (Mistral's
    ``sliding_window``, Qwen2's "sliding_attention" ``layer_types``) attend over the whole
    context instead, and ``max_model_len`` is capped at the smallest window (up to which
    the model's output is unchanged); a larger ``max_model_len`` raises ``ValueError``. No
    effect on a model without windows. Without it, windows are served as the model defines
    them (``pagedllm.arch_config.layer_sliding_windows``).

    ``speculative_config``: vLLM's dict, checked by ``SpeculativeConfig.from_dict``.

    ``kv_transfer_config`` / ``role``: a prefill / decode split (``KVTransferConfig``); not
    with prefix caching yet.

    ``runner`` / ``convert`` / ``pooler_config`` (vLLM's): a pooling model's settings
    (``pagedllm.config.pooler``): ``runner`` "auto" serves an encoder (``BertModel`` ...) or a
    ``convert="embed"`` checkpoint as a pooling model, whose ``ModelConfig.pooler_config`` is
    resolved from ``pooler_config``, the sentence-transformers files and the architecture;
    a pooling model has prefix caching only with causal attention and LAST pooling
    (``ModelConfig.is_prefix_caching_supported``), and an encoder no chunked prefill.

    ``hf_overrides`` (vLLM's): a dict merged into the model's HF config once it is read,
    before anything checks it (``pagedllm.config.hub.apply_hf_overrides``); the default
    ``max_model_len`` follows the rope scaling it sets (``pagedllm.arch_config.model_context_len``).

    Raises (constructor):
        ValueError: a value of ``PARTLY_BUILT_ARGS`` that is not built; ``max_logprobs`` < -1;
            a bad ``speculative_config`` (the message names the key); a bad
            ``structured_outputs_config``; a bad ``kv_transfer_config`` or ``role``, or either
            with ``enable_prefix_caching``.
    """

    model: Optional[str] = flag_field(
        None,
        help=(
            "Model directory (Hugging Face layout), .gguf file or Hub id; serve: same as MODEL (vLLM's "
            "older form). Default: the small model shipped with pagedllm."
        ),
        group="model",
    )
    tokenizer: Optional[str] = flag_field(
        None,
        help="Tokenizer directory or Hub id (default: the model's).",
        group="model",
    )
    revision: Optional[str] = flag_field(
        None,
        help="Model revision on the Hub: branch, tag or commit (default: main).",
        group="model",
    )
    tokenizer_revision: Optional[str] = flag_field(
        None,
        help="Tokenizer revision on the Hub (default: main).",
        group="model",
    )
    download_dir: Optional[str] = flag_field(
        None,
        help="Directory for downloaded models (default: the Hugging Face cache, $HF_HOME/hub).",
        group="model",
    )
    hf_overrides: Optional[dict] = flag_field(
        None,
        help=(
            "Keys merged into the model's Hugging Face config after it is read, as JSON; a nested "
            'object is merged key by key, e.g. \'{"rope_parameters": {"rope_type": "yarn", "factor": 4.0, '
            '"original_max_position_embeddings": 32768}}\' (4.x\'s rope_scaling / rope_theta also '
            "work) to serve past the original context with --max-model-len."
        ),
        type=json_object, metavar="JSON",
    )
    dtype: Any = flag_field(
        "auto",
        help=(
            "Compute dtype. 'auto': the checkpoint's, with float32 (and float16 on CPU) turned into "
            "the platform's 16-bit type."
        ),
        choices=("auto", *DTYPES),
    )
    max_model_len: Optional[int] = flag_field(
        None,
        help=(
            "Context length in tokens (prompt + output), e.g. 8192, 32k (=32000), 32K (=32768), 1M. "
            "Default: the model's max_position_embeddings, scaled by its rope scaling as vLLM does "
            "(x factor for linear / dynamic; original_max_position_embeddings x factor for yarn)."
        ),
        type=max_model_len_type,
    )
    block_size: int = flag_field(
        16,
        help="Tokens per KV-cache block.",
        type=int_type, choices=SUPPORTED_BLOCK_SIZES,
    )
    max_num_seqs: int = flag_field(
        256,
        help="Most requests running at once.",
        type=positive_int,
    )
    max_num_active_seqs: Optional[int] = flag_field(
        None,
        help=(
            "Most requests admitted to RUNNING at once (default: --max-num-seqs, at most that); "
            "--max-num-seqs still sizes the batch. Lowering it preempts nothing."
        ),
        type=positive_int,
    )
    scheduling_policy: str = flag_field(
        "fcfs",
        help=(
            "Order of the waiting requests: 'fcfs' (arrival) or 'priority' (by the request's priority, "
            "lower first, ties by arrival; under KV-cache pressure the lowest-priority running request "
            "is preempted first, and a prompt still in prefill yields the step to a higher-priority "
            "arrival)."
        ),
        choices=SCHEDULING_POLICIES,
    )
    max_num_batched_tokens: Optional[int] = flag_field(
        None,
        help=(
            "Token budget of one engine step (default, as vLLM: 2048 on CPU, 8192 on GPU, at least "
            "--max-num-seqs)."
        ),
        type=human_readable_int,
    )
    kv_cache_memory_bytes: Optional[int] = flag_field(
        None,
        help="Exact KV-cache size in bytes (e.g. 512M, 4G); overrides --gpu-memory-utilization.",
        type=human_readable_int,
    )
    gpu_memory_utilization: float = flag_field(
        0.9,
        help=(
            "Fraction of device memory (on CPU: of the RAM available at start-up) for weights, "
            "activations and KV cache."
        ),
        type=fraction_type,
    )
    seed: int = flag_field(
        0,
        help="Global random seed.",
        type=int_type,
    )
    enable_prefix_caching: bool = flag_field(
        True,
        help="Automatic prefix caching: reuse the KV cache of shared prompt prefixes.",
        action=argparse.BooleanOptionalAction,
    )
    prefix_caching_hash_algo: str = flag_field(
        "sha256",
        help=(
            "Hash of prefix-cache blocks: sha256 (default), sha256_cbor, or xxhash (faster, not "
            "cryptographic)."
        ),
        choices=("sha256", "sha256_cbor", "xxhash"),
    )
    kv_offloading_size: Optional[float] = flag_field(
        None,
        help=(
            "A second KV tier of this many GiB (all ranks together): blocks evicted from the prefix "
            "cache are kept there (host RAM, or files under --kv-offloading-path) and loaded back on a "
            "prefix hit, in the background. Needs prefix caching."
        ),
        type=positive_float,
    )
    kv_offloading_path: Optional[str] = flag_field(
        None,
        help="A local directory for the second KV tier's blocks (one file per block) instead of host RAM.",
    )
    attention_backend: Optional[str] = flag_field(
        None,
        help=(
            "Attention backend: CPU_ATTN (C++ CPU kernel), TORCH_SDPA (portable PyTorch) or a "
            "registered one. Default: $PAGEDLLM_ATTENTION_BACKEND, else chosen by platform."
        ),
        metavar="NAME",
    )
    generation_config: str = flag_field(
        "auto",
        help=(
            "Default sampling parameters of requests that do not set them: 'auto' takes the model's "
            "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
            "max_new_tokens), 'vllm' uses vLLM's defaults, a FOLDER reads its generation_config.json "
            "(its max_new_tokens also caps every request)."
        ),
        metavar="{auto,vllm,FOLDER}",
    )
    override_generation_config: Optional[dict] = flag_field(
        None,
        help=(
            'Sampling defaults that replace the generation config\'s, e.g. \'{"temperature": 0.5}\' '
            "(same fields as --generation-config)."
        ),
        type=json_object, metavar="JSON",
    )
    usage_context: str = not_a_flag(
        "llm", why="set by the caller: 'llm' for LLM / offline, 'api_server' for pagedllm serve"
    )
    quantization: Optional[str] = flag_field(
        None,
        help=(
            "Weight format. Quantize a 16/32-bit checkpoint at load: int8 = weight-only int8, one "
            "scale per output channel (half the bytes of bf16 per decode step); int4 = weight-only "
            "4-bit, symmetric groups of 32 as llama.cpp's Q4_0 (a quarter; --quantization-config for "
            "128); fp8 = e4m3 weights, one scale per tensor (vLLM's online FP8). Checkpoint formats, "
            "read from config.json (naming one here checks it): gptq, awq, compressed-tensors (W4A16 "
            "/ W8A16 pack-quantized), fp8; a .gguf MODEL is read as gguf. Default: the checkpoint's "
            "own format."
        ),
        aliases=("-q",),
    )
    limit_mm_per_prompt: Optional[dict] = flag_field(
        None,
        help=(
            'Image-text models: the most items of each modality one prompt may carry, as JSON, e.g. '
            '\'{"image": 2, "video": 1}\' (a request over it is refused). Default: no limit.'
        ),
        type=json_object, metavar="JSON",
    )
    media_io_kwargs: Optional[dict] = flag_field(
        None,
        help=(
            'Options of loading media from chat URLs, per modality, as JSON: \'{"video": {"num_frames": 8}}\' '
            "samples each video to 8 frames spread evenly over it (-1: every frame; default 32)."
        ),
        type=json_object, metavar="JSON",
    )
    mm_processor_kwargs: Optional[dict] = flag_field(
        None,
        help=(
            "Image-text models: options of every call of the model's transformers processor, as "
            "JSON (a request's own mm_processor_kwargs go over them, with --trust-request-mm-kwargs)."
        ),
        type=json_object, metavar="JSON",
    )
    trust_request_mm_kwargs: bool = flag_field(
        False,
        help="Let requests set mm_processor_kwargs (refused otherwise).",
        action="store_true",
    )
    allowed_local_media_path: Optional[str] = flag_field(
        None,
        help=(
            "Folder under which file:// image URLs of chat requests may be read (default: none, "
            "file:// URLs are refused). Only for trusted clients."
        ),
        metavar="FOLDER",
    )
    allowed_media_domains: Optional[list[str]] = flag_field(
        None,
        help="Host names http(s):// image URLs of chat requests may point at (default: any).",
        nargs="+", metavar="DOMAIN",
    )
    quantization_config: Optional[dict] = flag_field(
        None,
        help=(
            "Options of a --quantization applied at load, as JSON (vLLM's quantization_config): int4 "
            'reads \'{"group_size": 128}\' (32, 64 or 128; default 32).'
        ),
        type=json_object, metavar="JSON",
    )
    disable_log_stats: bool = flag_field(
        False,
        help=(
            "Do not log the engine's statistics line (throughput, running and waiting requests, "
            "KV-cache usage, prefix-cache hit rate) every $PAGEDLLM_LOG_STATS_INTERVAL seconds "
            "(default 10) while it works."
        ),
        action="store_true", group="server",
    )
    otlp_traces_endpoint: Optional[str] = flag_field(
        None,
        help=(
            "Send one OpenTelemetry span per request (vLLM's llm_request span: gen_ai.* attributes) to "
            "this OTLP/gRPC collector, e.g. http://127.0.0.1:4317."
        ),
        metavar="URL",
    )
    collect_detailed_traces: Optional[list[str]] = flag_field(
        None,
        help=(
            "With --otlp-traces-endpoint: also record each request's engine timeline (queued, scheduled, "
            "first and last token) as span events; a comma-separated list of all, model, worker (vLLM's values)."
        ),
        type=detailed_traces_type, metavar="MODULES",
    )
    distributed_executor_backend: Union[str, type, None] = flag_field(
        None,
        help=(
            "How workers run: 'uni' (one worker in the engine process; the default for one worker), "
            "'mp' (one process per worker on this machine; the default for more) or 'ray' (one Ray "
            "actor per worker on the nodes of a Ray cluster, `ray start`; the default when Ray is "
            "connected); 'external_launcher' is not supported yet."
        ),
        choices=("ray", "mp", "uni", "external_launcher"),
    )
    # vLLM's other engine arguments (names and defaults as vLLM's ``EngineArgs``); partly built
    # ones: see ``PARTLY_BUILT_ARGS``.
    tensor_parallel_size: int = flag_field(
        1,
        help=(
            "Worker processes the model's layers are split over (tensor parallelism): one GPU each on"
            " CUDA, at least one core each on CPU."
        ),
        aliases=("-tp",), type=positive_int,
    )
    pipeline_parallel_size: int = flag_field(
        1,
        help=(
            "Pipeline stages the model's layers are split over, one worker process each (x the "
            "tensor-parallel size); at most the model's number of layers."
        ),
        aliases=("-pp",), type=positive_int,
    )
    data_parallel_size: int = flag_field(
        1,
        help=(
            "Engine replicas behind this server, each in its own process (on CPU: its own share of "
            "the cores; on CUDA: its own device; with -tp/-pp: its own workers, -dp x -tp x -pp in "
            "all); requests go to the least loaded one."
        ),
        aliases=("-dp",), type=positive_int,
    )
    enable_expert_parallel: bool = flag_field(
        False,
        help=(
            "Mixture-of-experts models: each tensor-parallel worker holds whole experts (a contiguous "
            "range of them) instead of a slice of every expert; tokens go to their experts' workers. "
            "With -dp N: the experts are spread over the data-parallel replicas, which exchange their "
            "tokens in every MoE layer and step in lockstep."
        ),
        action="store_true",
    )
    load_format: str = flag_field(
        "auto",
        help=(
            "Checkpoint format: 'auto' / 'safetensors' (*.safetensors), 'gguf' (a .gguf MODEL, also "
            "read under 'auto'), 'ipc_cache' (map the weights `pagedllm preload MODEL` holds, ready to run; "
            "'auto' maps them too when they match, else loads the checkpoint); the others are not supported yet."
        ),
        choices=(
            "auto", "safetensors", "pt", "npcache", "dummy", "tensorizer", "sharded_state", "gguf", "bitsandbytes",
            "mistral", "runai_streamer", "fastsafetensors", "ipc_cache",
        ),  # fmt: skip
    )
    enable_sleep_mode: bool = flag_field(
        False,
        help=(
            "Allow sleep() / wake_up() (POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping): level 1 frees "
            "the KV cache and moves the weights to a file, level 2 drops them (wake-up loads them again)."
        ),
        action="store_true",
    )
    kv_cache_dtype: str = flag_field(
        "auto",
        help=(
            "KV-cache dtype: 'auto' (the model's dtype), or FP8 ('fp8' = 'fp8_e4m3', 'fp8_e5m2'): one"
            " byte per element, twice the tokens of a 16-bit cache in the same memory, scaled by the "
            "checkpoint's k_scale / v_scale (else 1.0); 'bfloat16' and 'fp8_inc' are not supported "
            "yet."
        ),
        choices=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"),
    )
    calculate_kv_scales: bool = flag_field(
        False,
        help=(
            "With an FP8 KV cache: compute each layer's k_scale / v_scale from the first batch (amax "
            "/ 200 for keys, amax / 100 for values, as vLLM) instead of the checkpoint's or 1.0."
        ),
        action="store_true",
    )
    tokenizer_mode: str = flag_field(
        "auto",
        help="'auto' / 'hf': the Hugging Face fast tokenizer; the others are not supported yet.",
        choices=("auto", "hf", "slow", "mistral", "custom"),
    )
    runner: str = flag_field(
        "auto",
        help=(
            "What the model serves: 'generate' (text), 'pooling' (embeddings: LLM.embed, "
            "/v1/embeddings; classes and scores: LLM.classify / LLM.score, /classify, /v1/score, /v1/rerank), "
            "'auto' (pooling for an encoder such as BertModel, a *ForSequenceClassification model or with "
            "--convert embed / classify, else generate)."
        ),
        choices=RUNNER_TYPES,
    )
    convert: str = flag_field(
        "auto",
        help=(
            "'embed': serve a generative checkpoint (e.g. Qwen3, Llama) as an embedding model; 'classify': "
            "as a sequence classifier (its score head on the last token: /classify, /v1/score, /v1/rerank; "
            "the head from LM-head rows with --hf-overrides '{\"classifier_from_token\": [\"no\", \"yes\"]}'); "
            "'none' / 'auto': as it is."
        ),
        choices=CONVERT_TYPES,
    )
    task: Optional[str] = flag_field(
        None,
        help=(
            "vLLM's earlier form of --runner / --convert: 'generate', 'embed' (or 'embedding'), 'classify' "
            "(or 'score'): the runner, converting a causal LM to pool (--convert embed / classify); "
            "--runner and --convert win when given."
        ),
    )
    pooler_config: Optional[dict] = flag_field(
        None,
        help=(
            'Pooling of a pooling model, as JSON: \'{"pooling_type": "MEAN", "normalize": true}\' '
            "(LAST | MEAN | CLS). Default: the model's sentence-transformers files (modules.json), "
            "else CLS for an encoder, LAST for a decoder; normalize true."
        ),
        type=json_object, metavar="JSON",
    )
    enable_chunked_prefill: Optional[bool] = flag_field(
        None,
        help=(
            "Cut long prompts into chunks that fit --max-num-batched-tokens: always on here "
            "(--no-enable-chunked-prefill is not supported yet)."
        ),
        action=argparse.BooleanOptionalAction,
    )
    cpu_offload_gb: float = flag_field(
        0,
        help="0 only (offloading is not supported yet).",
        type=non_negative_float,
    )
    structured_outputs_config: Any = flag_field(
        None,
        help=(
            'Constrained decoding (response_format, structured_outputs, guided_*): \'{"backend": '
            '"auto"}\' (xgrammar, falling back to llguidance for what it cannot compile) | "xgrammar" '
            '| "guidance"; also disable_fallback, disable_any_whitespace, '
            "disable_additional_properties (true/false), max_whitespace_cnt, max_number_digits, "
            "max_string_length (bounds on JSON output; null: none)."
        ),
        type=json_object_type, metavar="JSON",
    )
    speculative_config: Optional[dict] = flag_field(
        None,
        help=(
            'Speculative decoding, as JSON (vLLM\'s keys): {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4} or {"model": DRAFT, '
            '"num_speculative_tokens": 4}.'
        ),
        type=json_object_type,
    )
    kv_transfer_config: Optional[dict] = flag_field(
        None,
        help=(
            'Disaggregated prefill / decode, as JSON (vLLM\'s keys): {"kv_connector": "TCPConnector", '
            '"kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_ip": "127.0.0.1", "kv_port": 14579, '
            '"kv_connector_extra_config": {"timeout_s": 10, "buffer_timeout_s": 120}} (docs/deployment.md).'
        ),
        type=json_object_type, metavar="JSON",
    )
    role: Optional[str] = flag_field(
        None,
        help=(
            "Shorthand for the kv_role of --kv-transfer-config: prefill (kv_producer) or decode "
            "(kv_consumer); alone it implies the TCP connector's defaults."
        ),
        choices=("prefill", "decode"),
    )
    enable_lora: bool = flag_field(
        False,
        help=(
            "Serve LoRA adapters (--lora-modules, or loaded at run time) over the base model, many in"
            " one batch."
        ),
        action="store_true",
    )
    max_loras: int = flag_field(
        1,
        help="LoRA adapters in one batch (device slots).",
        type=positive_int,
    )
    max_lora_rank: int = flag_field(
        16,
        help="Largest LoRA rank served.",
        type=positive_int,
    )
    max_cpu_loras: Optional[int] = flag_field(
        None,
        help="LoRA adapters kept loaded in CPU memory (LRU; default: --max-loras).",
        type=positive_int,
    )
    trust_remote_code: bool = flag_field(
        False,
        help=(
            "Let transformers run a checkpoint's own config code. The model must still be one of "
            "pagedllm's architectures."
        ),
        action="store_true",
    )
    max_logprobs: int = flag_field(
        20,
        help=(
            "Most logprobs per token a request may ask for (logprobs, top_logprobs, prompt_logprobs);"
            " -1: the vocabulary size. Requests asking more get a 400."
        ),
        type=int_type,
    )
    batch_invariant: bool = flag_field(
        False,
        help=(
            "Logprobs bit-identical whatever the batch, chunk size, prefix-cache state and preemption"
            " (as vLLM's VLLM_BATCH_INVARIANT=1): each matmul row and each attention query computed "
            "alone, in one fixed order; slower prefill (docs/benchmarks.md). Unquantized models "
            "without LoRA or speculative decoding."
        ),
        action="store_true",
    )
    num_gpu_blocks_override: Optional[int] = flag_field(
        None,
        help="Number of KV-cache blocks, exactly (no memory sizing).",
        type=positive_int,
    )
    disable_sliding_window: bool = flag_field(
        False,
        help=(
            "Attend over the whole context in layers with a sliding window, so every layer keeps all "
            "its KV-cache blocks (one full-attention KV-cache group), and cap --max-model-len at the "
            "smallest window (vLLM's behaviour). No effect on models without sliding windows."
        ),
        action="store_true",
    )
    # No-ops here (CUDA graphs, swapping and custom all-reduce do not exist in pagedllm):
    # accepted so vLLM launch lines run.
    enforce_eager: bool = flag_field(
        False,
        help="No-op: pagedllm captures no CUDA graphs.",
        action="store_true",
    )
    max_seq_len_to_capture: int = flag_field(
        8192,
        help="No-op: pagedllm captures no CUDA graphs.",
        type=positive_int,
    )
    swap_space: float = flag_field(
        4,
        help=(
            "GiB of CPU swap space per device. No-op: preempted requests are recomputed, never "
            "swapped."
        ),
        type=non_negative_float,
    )
    disable_custom_all_reduce: bool = flag_field(
        False,
        help="No-op: pagedllm has no custom CUDA all-reduce.",
        action="store_true",
    )
    compilation_config: Any = flag_field(
        None,
        help=(
            "vLLM's torch.compile and CUDA-graph settings: a JSON object, or an optimization level "
            "(-O3). No-op: pagedllm compiles nothing and captures no CUDA graphs."
        ),
        type=compilation_config_type, aliases=("-O",), metavar="JSON|LEVEL",
    )

    def __post_init__(self) -> None:
        """Refuse at once a value asking for something not built (``PARTLY_BUILT_ARGS``),
        a ``max_logprobs`` below -1, and bad LoRA limits (``LoRAConfig``).

        A size given as its flag's string (``max_model_len="32k"``, ``kv_cache_memory_bytes="4G"``)
        becomes the number the flag would give.

        Raises:
            ValueError: "``name=value`` is not supported yet (why); supported: ...", or
                "``name``: invalid value ..." for a size string its flag refuses.
        """
        self._parse_size_strings()
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
        self._kv_transfer_config()
        if self.otlp_traces_endpoint is not None:
            ObservabilityConfig(self.otlp_traces_endpoint)  # checks its form
            if self.usage_context != "api_server":
                raise ValueError(
                    "otlp_traces_endpoint is not supported yet offline (LLM, pagedllm bench): request spans are "
                    "sent by the server (pagedllm serve --otlp-traces-endpoint URL)."
                )
        PoolerConfig.from_dict(self.pooler_config)
        check_data_parallel_size(self.data_parallel_size, self.usage_context)
        for name, (supported, why) in PARTLY_BUILT_ARGS.items():
            value = getattr(self, name)
            if isinstance(value, type):  # an Executor subclass as distributed_executor_backend
                continue
            if value not in supported:
                allowed = ", ".join(repr(v) for v in supported)
                raise ValueError(f"{name}={value!r} is not supported yet ({why}); supported: {allowed}.")

    def _parse_size_strings(self) -> None:
        """Each size field given as a string (offline ``LLM(...)`` keywords) parsed by its
        flag's type (``human_readable_int``, ``max_model_len_type``), as the CLI parses it.

        Raises:
            ValueError: "``name``: invalid value ...", the flag type's message.
        """
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag = f.metadata.get(FLAG)
            if isinstance(value, str) and flag is not None and flag.type in _SIZE_TYPES:
                try:
                    setattr(self, f.name, flag.type(value))
                except argparse.ArgumentTypeError as exc:
                    raise ValueError(f"{f.name}: {exc}") from None

    def create_engine_config(self, log_choices: bool = True) -> EngineConfig:
        """Check the arguments and resolve defaults; ``log_choices``: log what "auto" values
        resolved to (INFO). An engine process that resolves the arguments its front end
        resolves too passes False, so that each choice is logged once.

        Raises:
            ValueError: naming the bad argument and its allowed values.
        """
        self._check_sizes()
        check_generation_config(self.generation_config)
        from pagedllm.kernels import isa

        isa.selected_isa()  # a bad PAGEDLLM_CPU_ISA fails here, before anything is loaded
        model_path = resolve_model_path(self.model, self.revision, self.download_dir)
        tokenizer_path = (
            resolve_model_path(self.tokenizer, self.tokenizer_revision, self.download_dir)
            if self.tokenizer
            else model_path
        )
        hf_config = load_hf_config(model_path, self.trust_remote_code, self.hf_overrides)
        check_hf_config(hf_config)
        max_model_len = self._max_model_len(hf_config)
        architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
        runner, convert = runner_and_convert(self.task, self.runner, self.convert, architecture)
        runner_type = resolve_runner(runner, convert, architecture)
        if is_classifier(architecture, convert):
            set_classifier_from_token(hf_config)
        if runner_type == "pooling" and self.speculative_config is not None:
            raise ValueError("speculative_config with a pooling model is not supported (it generates no tokens).")
        scheduler_config = self._scheduler_config(max_model_len, runner_type, hf_config)
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
            hf_overrides=self.hf_overrides,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
            max_logprobs=self.max_logprobs,
            batch_invariant=self.batch_invariant,
            runner_type=runner_type,
            pooler_config=self._pooler_config(runner_type, hf_config, model_path),
            convert_type=convert if convert in ("embed", "classify") else "none",
            multimodal_config=MultiModalConfig.from_engine_args(
                self.limit_mm_per_prompt, self.mm_processor_kwargs, self.trust_request_mm_kwargs,
                self.allowed_local_media_path, self.allowed_media_domains, self.media_io_kwargs),
            load_format=self.load_format,
            enable_sleep_mode=self.enable_sleep_mode,
        )
        model_config.pooling_activations  # a classifier's activation not built fails here, before loading
        self._check_num_gpu_blocks_override(max_model_len)
        cache_config = CacheConfig.from_engine_args(self, max_model_len)
        if cache_config.enable_prefix_caching and not model_config.is_prefix_caching_supported:
            # NOTE: a prefix hit would skip the hidden states MEAN / CLS pooling (or an encoder) needs.
            cache_config = dataclasses.replace(cache_config, enable_prefix_caching=False)
        parallel_config = ParallelConfig.from_engine_args(self, model_config)
        speculative_config = self._speculative_config(model_config, parallel_config)
        if cache_config.kv_offloading_size is not None and speculative_config is not None and (
                speculative_config.uses_draft_model or speculative_config.is_eagle):
            raise ValueError("kv_offloading_size with a draft model or EAGLE head is not supported (the drafter's own "
                             "KV cache is not offloaded).")
        return EngineConfig(
            model_config, cache_config, scheduler_config, parallel_config, AttentionConfig(self.attention_backend),
            lora_config=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None,
            speculative_config=speculative_config,
            structured_outputs_config=StructuredOutputsConfig.from_dict(self.structured_outputs_config),
            observability_config=self._observability_config(),
            kv_transfer_config=self._kv_transfer_config(),
        )  # fmt: skip

    def _kv_transfer_config(self) -> Optional[KVTransferConfig]:
        """``kv_transfer_config`` and ``role`` checked (``KVTransferConfig.from_args``; None: no
        prefill / decode split).

        Raises:
            ValueError: a bad config; prefix caching on with a split (not built yet: a
                consumer's loaded blocks are not hashed, and a producer's cache hits would
                have to be sent too), data parallelism, or a drafter with its own KV cache.
        """
        config = KVTransferConfig.from_args(self.kv_transfer_config, self.role)
        if config is not None and self.enable_prefix_caching:
            raise ValueError(
                "enable_prefix_caching is not supported yet with kv_transfer_config / role (prefill / decode "
                "instances); pass --no-enable-prefix-caching (LLM: enable_prefix_caching=False)."
            )
        if config is not None and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 is not supported yet with kv_transfer_config / role (the replicas "
                             "would share one kv_port); run one instance per replica behind pagedllm router.")
        if (config is not None and self.speculative_config is not None
                and SpeculativeConfig.from_dict(self.speculative_config).uses_draft_model):
            raise ValueError("speculative_config with a draft model or EAGLE head is not supported yet with "
                             "kv_transfer_config / role (the drafter's KV cache is not transferred); n-gram is.")
        return config

    def _observability_config(self) -> ObservabilityConfig:
        """The tracing settings (``ObservabilityConfig``, which checks them: an endpoint's form,
        and that detailed traces have one).

        Raises:
            ValueError: see ``ObservabilityConfig``.
        """
        modules = self.collect_detailed_traces
        return ObservabilityConfig(self.otlp_traces_endpoint, None if modules is None else tuple(modules))

    def _scheduler_config(self, max_model_len: int, runner_type: str, hf_config: PretrainedConfig) -> SchedulerConfig:
        """The batching limits; for an encoder (one pass over the whole prompt) no chunked
        prefill, as vLLM; for a model whose images attend both ways no step that cuts an image.

        Raises:
            ValueError: a bad token budget; for an encoder, a budget below ``max_model_len``;
                for images that are not cut, a budget below one image's tokens.
        """
        architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
        config = SchedulerConfig.from_engine_args(self, max_model_len)
        if architecture in BIDIRECTIONAL_IMAGE_ARCHITECTURES:
            from pagedllm.multimodal.budget import max_tokens_per_mm_item

            per_item = max_tokens_per_mm_item(hf_config)
            if per_item is not None and config.max_num_batched_tokens < per_item:
                raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than one "
                                 f"image's {per_item} tokens, which {architecture} computes in one step.")
            return dataclasses.replace(config, disable_chunked_mm_input=True)
        if runner_type != "pooling" or not is_encoder_architecture(architecture):
            return config
        if config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}): {architecture} computes each prompt in one step (no chunked prefill)."
            )
        return dataclasses.replace(config, chunked_prefill_enabled=False)

    def _pooler_config(self, runner_type: str, hf_config: PretrainedConfig, model_path: Any) -> Optional[PoolerConfig]:
        """The resolved ``PoolerConfig`` of a pooling runner (``default_pooler_config``); None otherwise.

        Raises:
            ValueError: ``pooler_config`` given to a generating model.
        """
        if runner_type != "pooling":
            if self.pooler_config:
                raise ValueError("pooler_config is set, but the model is not a pooling model (--runner pooling).")
            return None
        model_dir = model_path.parent if model_path.is_file() else model_path
        architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
        return default_pooler_config(architecture, model_dir, PoolerConfig.from_dict(self.pooler_config), hf_config)

    def _check_sizes(self) -> None:
        """``block_size``, ``max_num_seqs`` and ``gpu_memory_utilization`` in range.

        Raises:
            ValueError: naming the argument and its allowed values.
        """
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")

    def _max_model_len(self, hf_config: PretrainedConfig) -> int:
        """``max_model_len``, or the model's context length; with ``disable_sliding_window``
        the model's windows are turned off in ``hf_config`` and the length capped at the
        smallest (vLLM's rule: full attention computes what the model does only up to it).

        Raises:
            ValueError: a ``max_model_len`` above the model's (or the window's) length.
        """
        derived, derived_from = derived_max_model_len(hf_config), "max_position_embeddings in config.json and its rope scaling"
        encoder_len = encoder_context_len(hf_config)
        if encoder_len is not None:
            derived, derived_from = encoder_len, "max_position_embeddings less the positions before pad_token_id + 1"
        window = min_sliding_window(hf_config)
        if self.disable_sliding_window and window is not None:
            if window < derived:
                derived, derived_from = window, "the sliding window, as --disable-sliding-window caps it"
            disable_sliding_window(hf_config)
        max_model_len = self.max_model_len or derived
        if max_model_len > derived:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's maximum context "
                f"length ({derived}, {derived_from})."
            )
        return max_model_len

    def _speculative_config(
        self, model_config: ModelConfig, parallel_config: ParallelConfig
    ) -> Optional[SpeculativeConfig]:
        """``speculative_config`` checked and its draft model resolved (None: off).

        Raises:
            ValueError: with pipeline parallelism, or a bad draft model (``resolve_draft_model``).
        """
        if self.speculative_config is None:
            return None
        if parallel_config.pipeline_parallel_size > 1:
            raise ValueError(
                f"speculative_config with pipeline_parallel_size {self.pipeline_parallel_size} is not supported yet "
                f"(drafts are verified on the last stage only); use pipeline_parallel_size 1."
            )
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        return spec.resolve_draft_model(model_config, None, self.download_dir)

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

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The ``EngineArgs`` of parsed flags (vLLM's method): every field that is a flag,
        from ``args`` (a parser given ``add_engine_args``), then ``overrides`` (e.g.
        ``usage_context``).

        Raises:
            ValueError: ``args`` lacks a flag (its parser did not get ``add_engine_args``), or
                a bad value (see the constructor).
        """
        return cls(**{**flag_values(cls, args), **overrides})


def add_engine_args(parser: Any, groups: Optional[Mapping[str, Any]] = None, *, unset: bool = False) -> None:
    """Add ``EngineArgs``' flags to ``parser`` (``pagedllm serve``, the engine benchmarks).

    The model flags (``--model``, ``--tokenizer``, revisions, ``--download-dir``) go to
    ``groups["model"]``, the others to ``groups["engine"]`` and ``groups["server"]``
    (``--disable-log-stats``); a group not given is ``parser`` itself for "model", else
    a new argument group "engine". ``unset``: every default is None, so that a caller
    passes on only the flags given (``given_engine_kwargs``) and the rest keep ``LLM``'s
    defaults.
    """
    groups = dict(groups or {})
    groups.setdefault("model", parser)
    if "engine" not in groups:
        groups["engine"] = parser.add_argument_group("engine")
    groups.setdefault("server", groups["engine"])
    add_flags(EngineArgs, groups, unset=unset)


def given_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments of the engine flags in ``args`` that are not None
    (with ``add_engine_args(..., unset=True)``: those given on the command line)."""
    return given_flag_values(EngineArgs, args)
