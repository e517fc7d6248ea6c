"""TTFT of a repeated long context after other requests evicted it from the KV cache, with and
without the second KV tier (``--kv-offloading-size``), in-process.

    python benchmarks/kv_offloading.py --model benchmarks/checkpoints/tiny-llama --dtype float32 \\
        --context 8192 --num-fillers 2 --repeats 3

Each repeat, on one engine per setting (same KV cache: room for about ``--cache-contexts``
contexts): the context plus a question runs once (cold), then ``--num-fillers`` other
prompts of the same length push its blocks out of the cache, then the context with another
question runs again; the time to its first token (one output token, measured around
``generate``) is the number reported. With the tier the evicted blocks come back from it
(host RAM, or ``--kv-offloading-path``); without it they are computed again. The machine's
load average is printed before and after, as the numbers depend on it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from pagedllm import LLM, SamplingParams

BLOCK_SIZE = 16


def _prompts(context: int, num_fillers: int, vocab: int, seed: int) -> tuple[list[int], list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    return draw(context), [draw(context + 32) for _ in range(num_fillers)], [draw(32) for _ in range(2)]


def _ttft(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return time.perf_counter() - start


def _one_setting(args: argparse.Namespace, offload: bool) -> dict:
    max_model_len = args.context + 64
    num_blocks = int(args.cache_contexts * -(-max_model_len // BLOCK_SIZE))
    tier = dict(kv_offloading_size=args.kv_offloading_size, kv_offloading_path=args.kv_offloading_path) if offload else {}
    llm = LLM(args.model, dtype=args.dtype, max_model_len=max_model_len, num_gpu_blocks_override=num_blocks,
              block_size=BLOCK_SIZE, hf_overrides={"max_position_embeddings": max_model_len}, **tier)
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    cold, evicted = [], []
    for repeat in range(args.repeats):
        context, fillers, (q1, q2) = _prompts(args.context, args.num_fillers, vocab, seed=repeat)
        cold.append(_ttft(llm, context + q1))
        for filler in fillers:
            _ttft(llm, filler)
        evicted.append(_ttft(llm, context + q2))
    core = llm.llm_engine.engine_core
    loaded = core.kv_cache_manager.offloading.num_loaded if offload else 0
    return {"cold": cold, "evicted": evicted, "blocks": num_blocks, "loaded_blocks": loaded}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=8192, help="tokens of the repeated context")
    parser.add_argument("--num-fillers", type=int, default=2, help="prompts of the context's length run in between")
    parser.add_argument("--cache-contexts", type=float, default=1.5, help="KV cache size, in contexts")
    parser.add_argument("--kv-offloading-size", type=float, default=4.0, help="GiB")
    parser.add_argument("--kv-offloading-path", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = {name: _one_setting(args, offload) for name, offload in (("without tier", False), ("with tier", True))}
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{args.model}, {args.context}-token context, KV cache {results['with tier']['blocks']} blocks of "
          f"{BLOCK_SIZE}, {args.num_fillers} fillers, {args.repeats} repeats; tier: "
          f"{args.kv_offloading_path or 'host RAM'}")
    print("| setting | cold TTFT s | TTFT after eviction s (each repeat) | median | blocks loaded from the tier |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {statistics.median(r['cold']):.3f} | {', '.join(f'{t:.3f}' for t in r['evicted'])} | "
              f"{statistics.median(r['evicted']):.3f} | {r['loaded_blocks']} |")
    speedup = statistics.median(results["without tier"]["evicted"]) / statistics.median(results["with tier"]["evicted"])
    print(f"TTFT after eviction: {speedup:.2f}x faster with the tier")


if __name__ == "__main__":
    main()
