"""Engine configuration: what to load, how big the cache is, how the scheduler batches.

``EngineArgs`` (``engine_args``) carries vLLM's argument names, and its fields the
command-line flags' metadata (``cli``); ``EngineArgs.create_engine_config`` checks them and
resolves defaults into an ``EngineConfig``, one sub-config per module: ``model``,
``cache``, ``scheduler``, ``parallel``, ``attention``, ``speculative``, ``lora``,
``structured_outputs``, ``kv_transfer``. ``hub`` finds models (local or on the Hugging Face Hub);
``vllm_compat`` lists vLLM's arguments accepted with only some values.

Importing this package imports neither torch nor transformers (``pagedllm serve`` reads
its flags before the engine process starts).
"""

from pagedllm.config.attention import AttentionConfig
from pagedllm.config.cache import CPU_KVCACHE_SPACE_ENV_VARS, KV_CACHE_DTYPES, SUPPORTED_BLOCK_SIZES, CacheConfig
from pagedllm.config.engine_args import EngineArgs
from pagedllm.config.engine_config import EngineConfig
from pagedllm.config.hub import HUB_ALLOW_PATTERNS, load_hf_config, resolve_model_path
from pagedllm.config.kv_transfer import KV_CONNECTORS, KV_ROLES, KVTransferConfig
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.model import (
    BATCH_INVARIANT_ENV,
    GENERATION_CONFIG_MODES,
    ModelConfig,
    batch_invariant_from_env,
    resolve_dtype,
)
from pagedllm.config.parallel import ParallelConfig, check_data_parallel_size
from pagedllm.config.scheduler import SchedulerConfig, default_max_num_batched_tokens
from pagedllm.config.speculative import EAGLE_HEAD_ARCHITECTURES, SPECULATIVE_METHODS, SpeculativeConfig
from pagedllm.config.structured_outputs import STRUCTURED_OUTPUTS_BACKENDS, StructuredOutputsConfig
from pagedllm.config.vllm_compat import PARTLY_BUILT_ARGS

__all__ = [
    "AttentionConfig", "BATCH_INVARIANT_ENV", "CPU_KVCACHE_SPACE_ENV_VARS", "CacheConfig", "EAGLE_HEAD_ARCHITECTURES",
    "EngineArgs", "EngineConfig", "KV_CONNECTORS", "KV_ROLES", "KVTransferConfig", "GENERATION_CONFIG_MODES", "HUB_ALLOW_PATTERNS", "KV_CACHE_DTYPES", "LoRAConfig",
    "ModelConfig", "PARTLY_BUILT_ARGS", "ParallelConfig", "SPECULATIVE_METHODS", "STRUCTURED_OUTPUTS_BACKENDS",
    "SUPPORTED_BLOCK_SIZES", "SchedulerConfig", "SpeculativeConfig", "StructuredOutputsConfig",
    "batch_invariant_from_env", "check_data_parallel_size", "default_max_num_batched_tokens", "load_hf_config",
    "resolve_dtype", "resolve_model_path",
]  # fmt: skip
