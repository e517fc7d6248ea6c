"""The model's KV-cache groups, and how many KV-cache blocks fit in the memory budget.

A layer's page (one block of it) = 2 (K and V) x block_size x num_kv_heads x head_dim x
cache dtype bytes (the model's dtype, or 1 for an FP8 cache: ``--kv-cache-dtype fp8`` holds
twice the tokens of a 16-bit cache in the same budget); with multi-head latent attention
(``ModelConfig.use_mla``) 1 (the latent) x block_size x 1 x (kv_lora_rank + qk_rope_head_dim)
x dtype bytes. Layers are grouped by attention
kind (``pagedllm.core.kv_cache_interface``); bytes per block = the page x the cache tensors
of this pipeline stage (the most layers of one group it holds: all its layers with one
kind of attention). ``num_kv_heads`` is this rank's (the KV heads its attention layers
hold; all of them at tensor-parallel size 1).

A request needs, per group, every block of its context (full attention) or those of its
window and step (a sliding window), or of its query's chunk and step (chunked local
attention), so the same budget admits more long requests in a model of mostly local layers.

State layers (Mamba-2, gated delta rule: ``pagedllm.arch_config.state_layer_indices``)
keep a fixed-size state per request instead (``MambaSpec``, whose shapes and dtypes the
model class gives: ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``,
vLLM's names); a hybrid layer (Falcon-H1's) keeps both, its attention in an attention group
and its mixer in a state group. The budget first sets aside the state slots (``num_state_slots``: one per
request that can run at once, three with prefix caching) x the state bytes of one request
over the stage's state layers; the rest buys attention blocks (none in a model of state layers
only; no limit from a pipeline stage that holds no attention layer of a hybrid model, which
allocates no attention block: ``NO_BLOCK_LIMIT``). Every stage uses the same slot ids, the
scheduler's, each in its own layers' state tensors.
An encoder-only pooling model has no KV-cache group at all: no blocks, no memory profiling,
and its requests are admitted by ``max_num_seqs`` / ``max_num_batched_tokens`` alone.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pagedllm.arch_config import (
    cacheless_layer_indices,
    hybrid_layer_indices,
    layer_attention_chunk_sizes,
    layer_sliding_windows,
    state_layer_indices,
)
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.core.kv_cache_interface import (
    LOCAL_ATTENTION_SPECS,
    KVCacheGroups,
    MambaSpec,
    cdiv,
    group_layers,
    layer_kv_cache_specs,
)
from pagedllm.distributed import get_pp_group, get_tensor_model_parallel_world_size, kv_heads_per_rank
from pagedllm.distributed.utils import pp_layer_range

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: What ``num_kv_blocks`` gives on a pipeline stage that holds no attention layer of a model
#: that has some: the stage stores no block, so the other stages' sizes decide (the executor
#: takes the smallest).
NO_BLOCK_LIMIT = sys.maxsize


def num_kv_heads_per_rank(model_config: ModelConfig) -> int:
    """KV heads of one layer on this tensor-parallel rank."""
    return kv_heads_per_rank(model_config.num_kv_heads, get_tensor_model_parallel_world_size())


def stage_layer_range(model_config: ModelConfig) -> tuple[int, int]:
    """Decoder layers ``[start, end)`` of this pipeline stage (``pp_layer_range``)."""
    pp = get_pp_group()
    return pp_layer_range(model_config.num_layers, pp.rank_in_group, pp.world_size)


def num_layers_per_stage(model_config: ModelConfig) -> int:
    """Decoder layers of this pipeline stage (``pp_layer_range``)."""
    start, end = stage_layer_range(model_config)
    return end - start


def kv_cache_groups(config: EngineConfig) -> KVCacheGroups:
    """The target model's KV-cache groups (the same on every rank and stage): its layers'
    windows (``layer_sliding_windows``) and chunks (``layer_attention_chunk_sizes``), block
    size, KV heads per tensor-parallel rank, head size and cache dtype. A drafter with its own
    KV cache (a draft model, an EAGLE head) writes through a full-attention group's table: when
    the target has no full-attention layer, its windowed or chunked layers keep every block
    (one full-attention group; the backend still masks the window or chunk). An encoder (``ModelConfig.is_encoder``: vLLM's "encoder_only"
    attention, over each whole prompt in one step) has no group: it keeps no KV cache.
    """
    model_config = config.model_config
    if model_config.is_encoder:
        return KVCacheGroups((), 0)
    windows = layer_sliding_windows(model_config.hf_config)[: model_config.num_layers]
    chunks = layer_attention_chunk_sizes(model_config.hf_config)[: model_config.num_layers]
    spec = config.speculative_config
    if spec is not None and spec.uses_draft_model and not any(w is None and c is None for w, c in zip(windows, chunks)):
        windows, chunks = [None] * len(windows), [None] * len(chunks)
    tp_size = config.parallel_config.tensor_parallel_size
    return _groups(model_config, config.cache_config, windows, tp_size, state_layer_specs(model_config, tp_size),
                   chunks)


def num_state_slots(config: EngineConfig, groups: KVCacheGroups) -> int:
    """State slots of each state group: ``max_num_seqs`` (a running request holds one), 3 x
    that with prefix caching (a request holds at most its working slot, its hit's and a save:
    ``MambaManager``; the saved states of finished requests stay in the free ones, LRU); 0
    without state layers."""
    if not groups.state_groups:
        return 0
    return config.scheduler_config.max_num_seqs * (3 if config.cache_config.enable_prefix_caching else 1)


def check_state_layers_compose(config: EngineConfig, groups: KVCacheGroups) -> None:
    """Refuse what is not built beside state layers: speculative decoding (a rejected draft
    would need its state rolled back), LoRA (no adapter for a state layer's projections).
    (Pipeline parallelism composes: each stage holds its own layers' states.)

    Raises:
        ValueError: naming the setting and the model's state layers.
    """
    if not groups.state_groups:
        return
    num_state_layers = sum(len(g.layer_indices) for g in groups.state_groups)
    model = (f"{config.model_config.architecture}, whose {num_state_layers} of {config.model_config.num_layers} "
             "layers keep a recurrent state")
    refused = [
        (config.speculative_config is not None, "speculative decoding (speculative_config)",
         "a rejected draft token would need its state rolled back"),
        (config.lora_config is not None, "LoRA (enable_lora)", "no adapter is built for a state layer"),
    ]
    for is_set, setting, why in refused:
        if is_set:
            raise ValueError(f"{setting} is not supported with {model}: {why}.")


def state_layer_specs(model_config: ModelConfig, tp_size: int = 1) -> dict[int, MambaSpec]:
    """Layer index -> ``MambaSpec`` of each state layer (none for most models) on each of
    ``tp_size`` tensor-parallel ranks (which hold their heads' states), from the model class's
    ``get_mamba_state_shape_from_config(hf_config, tp_size)`` and
    ``get_mamba_state_dtype_from_config(hf_config, dtype)`` (and its ``mamba_type``, the
    log's name of the state)."""
    layers = [i for i in state_layer_indices(model_config.hf_config) if i < model_config.num_layers]
    if not layers:
        return {}
    from pagedllm.model_executor.models.registry import get_model_class

    model_cls = get_model_class(model_config.architecture)
    hf_config = model_config.hf_config
    spec = MambaSpec(tuple(model_cls.get_mamba_state_shape_from_config(hf_config, tp_size)),  # type: ignore[attr-defined]
                     tuple(model_cls.get_mamba_state_dtype_from_config(hf_config, model_config.dtype)),  # type: ignore[attr-defined]
                     getattr(model_cls, "mamba_type", "mamba2"))
    return {i: spec for i in layers}


def _groups(model_config: ModelConfig, cache_config: CacheConfig, windows: list[Optional[int]],
            tp_size: int, state_specs: Optional[dict[int, MambaSpec]] = None,
            chunks: Optional[list[Optional[int]]] = None) -> KVCacheGroups:
    state_specs = state_specs or {}
    cacheless = [i for i in cacheless_layer_indices(model_config.hf_config) if i < len(windows)]
    hybrid = [i for i in hybrid_layer_indices(model_config.hf_config) if i in state_specs]
    if len(state_specs) - len(hybrid) + len(cacheless) == len(windows):  # no attention: no attention heads to read
        return group_layers([state_specs.get(i) for i in range(len(windows))])
    num_kv_heads = kv_heads_per_rank(model_config.num_kv_heads, tp_size)
    dtype_bytes = cache_config.kv_cache_dtype(model_config.dtype).itemsize
    return group_layers(layer_kv_cache_specs(windows, cache_config.block_size, num_kv_heads, model_config.head_dim,
                                             dtype_bytes, use_mla=model_config.use_mla, state_specs=state_specs,
                                             cacheless=cacheless, hybrid=hybrid, attention_chunk_sizes=chunks))


def kv_bytes_per_block(model_config: ModelConfig, groups: KVCacheGroups,
                       draft_model_config: Optional[ModelConfig] = None) -> int:
    """KV-cache bytes one block id takes on this stage and rank: one page in each of the
    stage's cache tensors (``num_stage_cache_tensors``), plus the draft model's block
    (``kv_bytes_per_token`` x block size) with speculative decoding."""
    num_tensors = num_stage_cache_tensors(groups, stage_layer_range(model_config))
    per_block = num_tensors * groups.groups[0].kv_cache_spec.page_size_bytes if groups.groups else 0
    if draft_model_config is not None:
        per_block += kv_bytes_per_token(draft_model_config) * groups.block_size
    return per_block


def num_stage_cache_tensors(groups: KVCacheGroups, layer_range: tuple[int, int]) -> int:
    """Cache tensors a stage holding layers ``[start, end)`` allocates: the most layers of
    one group among them (tensor j is shared by the j-th of them in every group)."""
    start, end = layer_range
    return max((sum(start <= i < end for i in g.layer_indices) for g in groups.groups), default=0)


def kv_bytes_per_token(model_config: ModelConfig, cache_dtype: Optional[torch.dtype] = None) -> int:
    """KV-cache bytes one token occupies across this stage's layers on this rank, in a cache
    of ``cache_dtype`` (None: the model's dtype; see ``CacheConfig.kv_cache_dtype``)."""
    itemsize = (cache_dtype or model_config.dtype).itemsize
    return (model_config.num_kv_cache_tensors * num_layers_per_stage(model_config) * num_kv_heads_per_rank(model_config)
            * model_config.head_dim * itemsize)


def no_kv_cache(config: EngineConfig) -> int:
    """The blocks of a model with no KV-cache group (an encoder: ``kv_cache_groups``): 0,
    sized without a budget or a profiling run, with the start-up log line saying so."""
    scheduler_config = config.scheduler_config
    logger.info("KV cache: none (%s is encoder-only: bidirectional attention over each whole prompt in one step, "
                "no KV-cache blocks); admission bounded by max_num_seqs = %d and max_num_batched_tokens = %d.",
                config.model_config.architecture, scheduler_config.max_num_seqs,
                scheduler_config.max_num_batched_tokens)
    return 0


@dataclass(frozen=True)
class KVCacheBudget:
    """The bytes the KV cache may take on one device, and how they were derived (the words
    of ``num_kv_blocks``' error message)."""

    num_bytes: int
    derivation: str


def blocks_per_sequence(groups: KVCacheGroups, max_model_len: int, max_num_batched_tokens: int) -> int:
    """Blocks one request of ``max_model_len`` tokens holds at most over every attention group
    (a sliding or chunked group: its window or chunk plus a step's ``max_num_batched_tokens``),
    plus the null block where a group has local attention."""
    return groups.max_num_blocks_per_request(max_model_len, max_num_batched_tokens) + int(groups.has_local_attention)


def check_num_gpu_blocks_override(config: EngineConfig, groups: KVCacheGroups, num_blocks: int) -> None:
    """``num_gpu_blocks_override`` = ``num_blocks`` against ``groups``: one ``max_model_len``
    request must fit in every group at once (the flag's own check counts one full-attention
    table only: ``EngineArgs``).

    Raises:
        ValueError: too few blocks; the message gives the blocks each group needs.
    """
    if not groups.groups:
        return
    max_len = config.model_config.max_model_len
    chunk = config.scheduler_config.max_num_batched_tokens
    needed = blocks_per_sequence(groups, max_len, chunk)
    if num_blocks >= needed:
        return
    per_group = " + ".join(f"{g.kv_cache_spec.max_num_blocks(max_len, chunk)} ({g.kv_cache_spec.describe()})"  # type: ignore[union-attr]
                           for g in groups.groups)
    null = " + 1 (the null block)" if groups.has_local_attention else ""
    raise ValueError(
        f"num_gpu_blocks_override={num_blocks} cannot hold one sequence of max_model_len = {max_len} tokens across "
        f"the model's {len(groups.groups)} KV-cache groups: that needs {per_group}{null} = {needed} blocks of "
        f"{config.cache_config.block_size} tokens (max_num_batched_tokens = {chunk}). Raise num_gpu_blocks_override "
        f"or lower max_model_len."
    )


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
    draft_model_config: Optional[ModelConfig] = None, groups: Optional[KVCacheGroups] = None,
    max_num_batched_tokens: Optional[int] = None, num_state_slots: int = 0,
) -> int:
    """Number of blocks: the budget (see ``kv_cache_budget``) divided by the bytes per block
    (of the target's cache tensors on this stage, in ``cache_config``'s dtype, and, with
    speculative decoding, the draft model's, in its own dtype, which has as many blocks),
    and, unless the size was given exactly, no more than the requests of
    ``max_kv_cache_tokens`` need (CPU). The log line gives the size, the tokens each
    group holds and where it came from.

    Args:
        groups: the target's KV-cache groups (``kv_cache_groups``); None: one
            full-attention group of every layer (this rank's heads).
        max_num_batched_tokens: the scheduler's token budget per step (the chunk a
            sliding-window group holds besides its window); None: ``max_model_len``.
        num_state_slots: state slots set aside first (``max_num_seqs``), each of
            ``groups.state_bytes_per_request`` bytes; unused without state layers.

    Returns:
        the number of attention blocks (0 for a model of state layers only).

    Raises:
        ValueError: if the budget cannot hold the state slots and one sequence of
            ``max_model_len`` tokens; the message gives the formula, the numbers and the
            settings to change.
    """
    cache_dtype = cache_config.kv_cache_dtype(model_config.dtype)
    block_size = cache_config.block_size
    max_len = model_config.max_model_len
    chunk = max_num_batched_tokens or max_len
    if groups is None:
        groups = _groups(model_config, cache_config, [None] * model_config.num_layers,
                         get_tensor_model_parallel_world_size())
    layer_range = stage_layer_range(model_config)
    state_bytes = num_state_slots * groups.stage_state_bytes_per_request(*layer_range)
    state_words = _check_state_slots(groups, num_state_slots, state_bytes, budget, layer_range)
    if not groups.groups:
        logger.info("KV cache: no attention layers; %s. Budget from %s.", state_words, budget.derivation)
        return 0
    num_tensors = num_stage_cache_tensors(groups, layer_range)
    if num_tensors == 0 and draft_model_config is None:
        logger.info("KV cache: none on this pipeline stage (layers %d .. %d hold no attention); %s. Budget from %s.",
                    layer_range[0], layer_range[1] - 1, state_words, budget.derivation)
        return NO_BLOCK_LIMIT
    per_block = kv_bytes_per_block(model_config, groups, draft_model_config)
    num_null = int(groups.has_local_attention)
    blocks_per_seq = blocks_per_sequence(groups, max_len, chunk)
    num_blocks = max(budget.num_bytes - state_bytes, 0) // per_block
    derivation = budget.derivation
    max_tokens = cache_config.max_kv_cache_tokens
    if cache_config.kv_cache_memory_bytes is None and max_tokens is not None:
        demand_blocks = _demand_blocks(groups, max_tokens, block_size, max_len, chunk) + num_null
        if demand_blocks < num_blocks:
            num_blocks = demand_blocks
            derivation = (
                f"what the configuration can use: {max_tokens:,} tokens (max_num_seqs x max_model_len"
                f"{', x 2 for prefix caching' if cache_config.enable_prefix_caching else ''}), below {derivation}"
            )
    if num_blocks < blocks_per_seq:
        tensors = (f"{num_tensors}: cache tensors of this stage's {num_layers_per_stage(model_config)} layers "
                   f"grouped by attention kind" if len(groups.groups) > 1 else f"{num_tensors}")
        raise ValueError(
            f"The KV cache cannot hold one sequence of max_model_len = {max_len} tokens. "
            f"KV bytes per token = {model_config.num_kv_cache_tensors} x num_layers ({tensors}) x num_kv_heads "
            f"({num_kv_heads_per_rank(model_config)}) x head_dim ({model_config.head_dim}) x dtype bytes "
            f"({cache_dtype.itemsize}) = {per_block // block_size:,}; one sequence needs {blocks_per_seq} blocks "
            f"of {block_size} tokens = {blocks_per_seq * per_block:,} bytes, but the budget "
            f"({budget.derivation}{f', less {state_words}' if state_bytes else ''}) holds {num_blocks} blocks. "
            f"Lower max_model_len{' or max_num_seqs' if state_bytes else ''}, or raise "
            f"kv_cache_memory_bytes / gpu_memory_utilization."
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %s, %.2f GiB; %s)%s; maximum concurrency for %d tokens per "
        "request: %.2fx. Budget from %s.",
        num_blocks,
        block_size,
        num_blocks * block_size,
        cache_config.cache_dtype_name(model_config.dtype),
        num_blocks * per_block / 2**30,
        _tokens_per_group(groups, num_blocks - num_null, block_size),
        f"; {state_words}" if state_bytes else "",
        max_len,
        (num_blocks - num_null) / (blocks_per_seq - num_null),
        derivation,
    )
    return int(num_blocks)


def _check_state_slots(groups: KVCacheGroups, num_slots: int, state_bytes: int, budget: KVCacheBudget,
                       layer_range: tuple[int, int]) -> str:
    """The log's words for the state slots set aside for the state layers of ``layer_range``
    (this stage's; empty without state layers).

    Raises:
        ValueError: a state model with no slot, or a budget that cannot hold the slots.
    """
    if not groups.state_groups:
        return ""
    kinds = ", ".join(sorted({g.kv_cache_spec.describe() for g in groups.state_groups}))
    per_request = groups.stage_state_bytes_per_request(*layer_range)
    start, end = layer_range
    num_layers = sum(start <= i < end for g in groups.state_groups for i in g.layer_indices)
    words = (f"state: {num_slots} slots of {per_request:,} bytes ({kinds} of "
             f"{num_layers} layers; {state_bytes / 2**30:.2f} GiB)")
    if num_slots < 1 or state_bytes > budget.num_bytes:
        raise ValueError(
            f"The KV cache cannot hold the recurrent states of max_num_seqs = {num_slots} requests: "
            f"{num_slots} x {per_request:,} bytes per request = {state_bytes:,} bytes, but the budget is "
            f"{budget.derivation}. Lower max_num_seqs, or raise kv_cache_memory_bytes / gpu_memory_utilization."
        )
    return words


def _demand_blocks(groups: KVCacheGroups, max_tokens: int, block_size: int, max_model_len: int, chunk: int) -> int:
    """Blocks the ``max_tokens / max_model_len`` longest requests ``max_kv_cache_tokens``
    counts need at once: ``max_tokens`` tokens in a full-attention group, a request's
    bound (``SlidingWindowSpec.max_num_blocks``) per request in a sliding or chunked one."""
    num_seqs = cdiv(max_tokens, max_model_len)
    return sum(num_seqs * g.kv_cache_spec.max_num_blocks(max_model_len, chunk)
               if isinstance(g.kv_cache_spec, LOCAL_ATTENTION_SPECS) else cdiv(max_tokens, block_size)
               for g in groups.groups)


def _tokens_per_group(groups: KVCacheGroups, num_blocks: int, block_size: int) -> str:
    """The log's words for the tokens each kind of group holds when the blocks are shared
    evenly among the groups (as vLLM reports them)."""
    tokens = num_blocks // len(groups.groups) * block_size
    kinds: dict[str, int] = {}
    for g in groups.groups:
        kinds[g.kv_cache_spec.describe()] = kinds.get(g.kv_cache_spec.describe(), 0) + 1
    return "; ".join(f"{kind}: {tokens} tokens" + (f" in each of {n} groups" if n > 1 else "")
                     for kind, n in kinds.items())
