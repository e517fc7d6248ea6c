"""Throughput of quantized weights against the model's own bf16, alternated in one process
(A, B, A, B ..., median), so a loaded machine's noise cancels out: the "32 x 128/128 with int8
>= 1.2x our own bf16" row of issue 14 under load.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quantized_ab.py --model benchmarks/checkpoints/qwen2-0.5b-shape \\
        --quantization int8 --num-prompts 32 --input-len 128 --output-len 128 --rounds 3

Two engines on the same checkpoint, ``dtype=--dtype``: one unquantized, one with
``quantization=--quantization`` (each with ``--kv-cache-memory-bytes`` of cache and
``--max-model-len``); ``--quantization-configs`` makes one quantized engine per JSON
(``quantization_config``), e.g. int4's groups of 32 (``'{}'``, the default) against 128:

    python benchmarks/quantized_ab.py --model benchmarks/checkpoints/qwen2-0.5b-shape --quantization int4 \\
        --quantization-configs '{}' '{"group_size": 128}' --num-prompts 1 --input-len 16 --output-len 64 \\
        --rounds 5 --kv-cache-memory-bytes 67108864 --cpu-time

Each round
generates ``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len`` tokens
each (EOS ignored, greedy), on every engine, each engine first in turn; prints output tokens/s
of each round, the medians and each quantized engine's ratio to bf16 (> 1: it is faster).
``--cpu-time``: one torch thread, each round timed by the process's CPU time
(``time.process_time``; the engine runs in this process), which other processes on a busy
machine do not stretch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--quantization-configs", nargs="+", default=["{}"], metavar="JSON",
                        help="one quantized engine per JSON quantization_config (default: one, '{}')")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by CPU time")
    args = parser.parse_args()

    import torch

    from pagedllm import LLM, SamplingParams

    if args.cpu_time:
        torch.set_num_threads(1)
    clock = time.process_time if args.cpu_time else time.perf_counter

    common = {"dtype": args.dtype, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
              "max_model_len": args.max_model_len}
    engines = {"bf16": LLM(model=args.model, **common)}
    for text in args.quantization_configs:
        options = json.loads(text)
        name = args.quantization + (f" {text}" if options else "")
        engines[name] = LLM(model=args.model, quantization=args.quantization, quantization_config=options or None, **common)
    vocab = engines["bf16"].get_tokenizer().vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, vocab - 10, (args.input_len,), generator=gen).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)

    def run(name: str) -> float:
        start = clock()
        outputs = engines[name].generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (clock() - start)

    names = list(engines)
    for name in names:  # warm-up: oneDNN primitives, the kernels' first calls
        engines[name].generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    results: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:  # each engine first in turn
            results[name].append(run(name))
            unit = "output tok per CPU-s" if args.cpu_time else "output tok/s"
            print(f"round {i + 1} {name}: {results[name][-1]:.1f} {unit}", flush=True)
    medians = {name: statistics.median(r) for name, r in results.items()}
    print(" | ".join(f"{name} median {m:.1f} tok/s" for name, m in medians.items()))
    for name in names[1:]:
        ratios = [q / b for q, b in zip(results[name], results["bf16"])]
        print(f"{name} / bf16 = {medians[name] / medians['bf16']:.2f}x (median of rounds' ratios "
              f"{statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
