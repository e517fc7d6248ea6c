"""``pagedllm serve --calculate-kv-cache-size``: the KV cache the flags give, without
loading the model or serving.

The size is the engine's own rule (``pagedllm.worker.kv_cache_sizing.num_kv_blocks``):
``num_gpu_blocks_override`` exactly, else the budget ``kv_cache_memory_bytes`` (or the CPU
KV-cache environment variable), else ``gpu_memory_utilization`` x the device memory less
the checkpoint's weight files (an upper bound: serving also subtracts the activation peak
it measures), capped on CPU by what the configuration can use. The blocks are shared by
the model's KV-cache groups; each group's line gives its even share (as the start-up log).
"""

from __future__ import annotations

from pathlib import Path

from pagedllm.config import EngineArgs

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def checkpoint_bytes(model_path: Path) -> int:
    """Bytes of a checkpoint's weight files (a folder's ``*.safetensors`` / ``*.bin`` /
    ``*.pt``, or a ``.gguf`` file)."""
    if model_path.is_file():
        return model_path.stat().st_size
    return sum(p.stat().st_size for p in model_path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)


def kv_cache_size_report(engine_args: EngineArgs) -> str:
    """Lines: the whole cache (blocks, tokens, bytes), then one line per KV-cache group.

    Raises:
        ValueError: a bad flag, or a cache that cannot hold one ``max_model_len`` sequence.
    """
    from pagedllm.platforms import current_platform
    from pagedllm.worker.kv_cache_sizing import (
        kv_bytes_per_block,
        kv_cache_budget,
        kv_cache_groups,
        num_kv_blocks,
        num_state_slots,
    )

    config = engine_args.create_engine_config(log_choices=False)
    model_config, cache_config = config.model_config, config.cache_config
    groups = kv_cache_groups(config)
    spec = config.speculative_config
    draft = spec.draft_model_config if spec is not None else None
    num_blocks = cache_config.num_gpu_blocks_override
    if num_blocks is None:
        budget = kv_cache_budget(cache_config, current_platform.total_memory_bytes(),
                                 checkpoint_bytes(model_config.model_path), 0)
        num_blocks = num_kv_blocks(model_config, cache_config, budget, draft, groups,
                                   config.scheduler_config.max_num_batched_tokens, num_state_slots(config, groups))
    per_block = kv_bytes_per_block(model_config, groups, draft)
    block_size = cache_config.block_size
    lines = [f"KV cache: {num_blocks * per_block} bytes, {num_blocks * block_size} tokens, {num_blocks} blocks "
             f"of {block_size} tokens ({per_block} bytes per block, "
             f"{cache_config.cache_dtype_name(model_config.dtype)})"]
    share = num_blocks // len(groups.groups) if groups.groups else 0
    for index, group in enumerate(groups.groups):
        lines.append(f"KV cache group {index} ({group.kv_cache_spec.describe()}, {len(group.layer_indices)} layers): "
                     f"{share * per_block} bytes, {share * block_size} tokens, {share} blocks")
    return "\n".join(lines)
