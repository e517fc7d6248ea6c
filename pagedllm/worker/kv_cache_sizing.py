"""How many KV-cache blocks fit in the memory budget.

bytes per token = 2 (K and V) x num_layers x num_kv_heads x head_dim x cache dtype bytes
(the model's dtype, or 1 for an FP8 cache: ``--kv-cache-dtype fp8`` holds twice the tokens of
a 16-bit cache in the same budget); with multi-head latent attention (``ModelConfig.use_mla``)
1 (the latent) x num_layers x 1 x (kv_lora_rank + qk_rope_head_dim) x dtype bytes;
bytes per block = bytes per token x block_size. ``num_kv_heads`` is this rank's (the KV heads
its attention layers hold; all of them at tensor-parallel size 1), ``num_layers`` this
pipeline stage's (all of them at pipeline-parallel size 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.distributed import get_pp_group, get_tensor_model_parallel_world_size, kv_heads_per_rank
from pagedllm.distributed.utils import pp_layer_range

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def num_kv_heads_per_rank(model_config: ModelConfig) -> int:
    """KV heads of one layer on this tensor-parallel rank."""
    return kv_heads_per_rank(model_config.num_kv_heads, get_tensor_model_parallel_world_size())


def num_layers_per_stage(model_config: ModelConfig) -> int:
    """Decoder layers of this pipeline stage (``pp_layer_range``)."""
    pp = get_pp_group()
    start, end = pp_layer_range(model_config.num_layers, pp.rank_in_group, pp.world_size)
    return end - start


def kv_bytes_per_token(model_config: ModelConfig, cache_dtype: Optional[torch.dtype] = None) -> int:
    """KV-cache bytes one token occupies across this stage's layers on this rank, in a cache
    of ``cache_dtype`` (None: the model's dtype; see ``CacheConfig.kv_cache_dtype``)."""
    itemsize = (cache_dtype or model_config.dtype).itemsize
    return (model_config.num_kv_cache_tensors * num_layers_per_stage(model_config) * num_kv_heads_per_rank(model_config)
            * model_config.head_dim * itemsize)


@dataclass(frozen=True)
class KVCacheBudget:
    """The bytes the KV cache may take on one device, and how they were derived (the words
    of ``num_kv_blocks``' error message)."""

    num_bytes: int
    derivation: str


def kv_cache_budget(
    cache_config: CacheConfig, memory_bytes: int, weights_bytes: int, activation_peak_bytes: int
) -> KVCacheBudget:
    """``kv_cache_memory_bytes`` if set (by argument or environment), else
    ``gpu_memory_utilization x memory_bytes - weights - activation peak`` (all in bytes;
    negative when the weights and activations alone exceed the share)."""
    if cache_config.kv_cache_memory_bytes is not None:
        budget = cache_config.kv_cache_memory_bytes
        return KVCacheBudget(budget, f"{cache_config.kv_cache_memory_source} = {budget:,}")
    budget = int(cache_config.gpu_memory_utilization * memory_bytes) - weights_bytes - activation_peak_bytes
    return KVCacheBudget(
        budget,
        f"gpu_memory_utilization {cache_config.gpu_memory_utilization} x {memory_bytes:,} bytes of "
        f"device memory - {weights_bytes:,} bytes of weights - {activation_peak_bytes:,} bytes of "
        f"activation peak = {budget:,}",
    )


def num_kv_blocks(
    model_config: ModelConfig, cache_config: CacheConfig, budget: KVCacheBudget,
    draft_model_config: Optional[ModelConfig] = None,
) -> int:
    """Number of blocks: the budget (see ``kv_cache_budget``) divided by the bytes per block
    (of the target's cache, in ``cache_config``'s dtype, and, with speculative decoding, the
    draft model's, in its own dtype, which has as many blocks),
    and, unless the size was given exactly, no more than ``max_kv_cache_tokens`` hold (CPU).
    The log line gives the size and where it came from.

    Raises:
        ValueError: if the budget cannot hold one sequence of ``max_model_len`` tokens;
            the message gives the formula, the numbers and the settings to change.
    """
    cache_dtype = cache_config.kv_cache_dtype(model_config.dtype)
    per_token = kv_bytes_per_token(model_config, cache_dtype)
    if draft_model_config is not None:
        per_token += kv_bytes_per_token(draft_model_config)
    per_block = per_token * cache_config.block_size
    num_blocks = max(budget.num_bytes, 0) // per_block
    derivation = budget.derivation
    max_tokens = cache_config.max_kv_cache_tokens
    if cache_config.kv_cache_memory_bytes is None and max_tokens is not None:
        demand_blocks = -(-max_tokens // cache_config.block_size)
        if demand_blocks < num_blocks:
            num_blocks = demand_blocks
            derivation = (
                f"what the configuration can use: {max_tokens:,} tokens (max_num_seqs x max_model_len"
                f"{', x 2 for prefix caching' if cache_config.enable_prefix_caching else ''}), below {derivation}"
            )
    max_len = model_config.max_model_len
    blocks_per_seq = -(-max_len // cache_config.block_size)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"The KV cache cannot hold one sequence of max_model_len = {max_len} tokens. "
            f"KV bytes per token = {model_config.num_kv_cache_tensors} x num_layers ({num_layers_per_stage(model_config)}) x num_kv_heads "
            f"({num_kv_heads_per_rank(model_config)}) x head_dim ({model_config.head_dim}) x dtype bytes "
            f"({cache_dtype.itemsize}) = {per_token:,}; one sequence needs {blocks_per_seq} blocks "
            f"of {cache_config.block_size} tokens = {blocks_per_seq * per_block:,} bytes, but the budget "
            f"({budget.derivation}) holds {num_blocks} blocks. Lower max_model_len, or raise "
            f"kv_cache_memory_bytes / gpu_memory_utilization."
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %s, %.2f GiB); maximum concurrency for %d tokens per "
        "request: %.2fx. Budget from %s.",
        num_blocks,
        cache_config.block_size,
        num_blocks * cache_config.block_size,
        cache_config.cache_dtype_name(model_config.dtype),
        num_blocks * per_block / 2**30,
        max_len,
        num_blocks / blocks_per_seq,
        derivation,
    )
    return int(num_blocks)
