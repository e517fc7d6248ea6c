"""KV-cache bytes per request and concurrent requests at one context length: the model's own
layout (KV-cache groups: sliding-window groups hold only the window's blocks) against the
all-full-attention layout of the same layers, from the engine's own sizing (no weights loaded).

    python benchmarks/kv_capacity.py --model benchmarks/checkpoints/gemma3-1b-shape \\
        --context 8192 --kv-cache-memory-bytes 4G

For each layout: the KV-cache groups, the bytes one block id takes, the KV bytes a request of
``--context`` tokens holds while it decodes (a sliding-window group: the window's blocks), the
most it holds at once (``KVCacheGroups.max_num_blocks_per_request``: while a prefill chunk of
``--max-num-batched-tokens`` tokens is in flight, what admission and the start-up "maximum
concurrency" line count), and how many such requests the budget holds at once
(``num_kv_blocks`` less the null block, divided by that most).
"""

from __future__ import annotations

import argparse

from pagedllm.config import EngineArgs
from pagedllm.config.arg_types import human_readable_int
from pagedllm.core.kv_cache_interface import KVCacheGroups, group_layers, layer_kv_cache_specs
from pagedllm.worker.kv_cache_sizing import kv_cache_budget, kv_cache_groups, num_kv_blocks


def _describe(groups: KVCacheGroups) -> str:
    kinds: dict[str, int] = {}
    for group in groups.groups:
        window = getattr(group.kv_cache_spec, "sliding_window", None)
        name = "full" if window is None else f"window {window}"
        kinds[name] = kinds.get(name, 0) + 1
    return ", ".join(f"{n} x {kind}" for kind, n in kinds.items()) + f" (groups of {groups.group_size} layers)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=8192, help="tokens per request (prompt + output)")
    parser.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=4 << 30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the prefill chunk (engine default)")
    args = parser.parse_args(argv)

    config = EngineArgs(
        model=args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=args.context,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_batched_tokens=args.max_num_batched_tokens,
    ).create_engine_config()
    model_config, cache_config = config.model_config, config.cache_config
    chunk = config.scheduler_config.max_num_batched_tokens
    hybrid = kv_cache_groups(config)
    spec = hybrid.groups[0].kv_cache_spec
    full = group_layers(layer_kv_cache_specs(
        [None] * model_config.num_layers, spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype_bytes,
    ))
    budget = kv_cache_budget(cache_config, 0, 0, 0)
    print(f"{args.model}: {model_config.num_layers} layers, {args.context}-token requests, "
          f"budget {budget.num_bytes:,} bytes, block size {args.block_size}, max_num_batched_tokens {chunk}")
    print("| layout | groups | bytes per block id | KV held while decoding | KV held at most | requests that fit |")
    print("|---|---|---|---|---|---|")
    fits = {}
    for name, groups in (("KV-cache groups (the model's windows)", hybrid), ("all full attention", full)):
        held = groups.max_num_blocks_per_request(args.context, 1)
        need = groups.max_num_blocks_per_request(args.context, chunk)
        num_blocks = num_kv_blocks(model_config, cache_config, budget, None, groups, chunk)
        fits[name] = (num_blocks - groups.has_sliding_window) / need
        print(f"| {name} | {_describe(groups)} | {groups.block_bytes:,} | {held * groups.block_bytes / 2**20:,.1f} MiB "
              f"| {need * groups.block_bytes / 2**20:,.1f} MiB | {fits[name]:.2f} |")
    hybrid_fit, full_fit = fits.values()
    print(f"ratio: {hybrid_fit / full_fit:.2f}x the requests in the same budget")


if __name__ == "__main__":
    main()
