"""``EngineConfig``: the resolved configuration of one engine, one sub-config per concern."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pagedllm.config.attention import AttentionConfig
from pagedllm.config.cache import CacheConfig
from pagedllm.config.kv_transfer import KVTransferConfig
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.model import ModelConfig
from pagedllm.config.observability import ObservabilityConfig
from pagedllm.config.parallel import ParallelConfig
from pagedllm.config.scheduler import SchedulerConfig
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.config.structured_outputs import StructuredOutputsConfig


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
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    kv_transfer_config: Optional[KVTransferConfig] = None  # None: no prefill / decode split
