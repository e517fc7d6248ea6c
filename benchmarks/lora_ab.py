"""Multi-LoRA overhead under load: base-only vs adapters mixed uniformly, alternated in one
process on one engine (A, B, A, B ..., median), so a loaded machine's noise cancels out.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/lora_ab.py --model benchmarks/checkpoints/qwen2-0.5b-shape \\
        --lora-path /tmp/lora16 --num-loras 8 --num-prompts 16 --input-len 32 --output-len 32 --rounds 2

Both variants run on the same ``LLM(enable_lora=True, max_loras=--num-loras)``: the base-only
rounds send no ``lora_request`` (no token has a slot, so no layer computes a delta), the LoRA
rounds send request i adapter ``i % --num-loras + 1`` (distinct ids over the same files, as
``bench throughput --lora-path`` does). Prints output tokens/s of each round, the medians and
their ratio. ``--profile``: one more LoRA round under ``torch.profiler``, the ops' table
(CPU time) printed.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--lora-path", required=True)
    parser.add_argument("--num-loras", type=int, default=8)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.lora.request import LoRARequest

    llm = LLM(model=args.model, dtype=args.dtype, enable_lora=True, max_loras=args.num_loras,
              max_lora_rank=args.max_lora_rank, max_cpu_loras=args.num_loras, kv_cache_memory_bytes=1 << 30)
    vocab = llm.get_tokenizer().vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, vocab - 10, (args.input_len,), generator=gen).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    loras = [LoRARequest(f"lora-{i % args.num_loras + 1}", i % args.num_loras + 1, args.lora_path)
             for i in range(args.num_prompts)]
    variants = {"base": None, "lora": loras}

    def run(name: str) -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=variants[name])
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)

    run("lora")  # warm-up: loads the adapters into their slots
    results: dict[str, list[float]] = {"base": [], "lora": []}
    for i in range(args.rounds):
        for name in (("base", "lora") if i % 2 == 0 else ("lora", "base")):
            results[name].append(run(name))
            print(f"round {i} {name}: {results[name][-1]:.1f} output tok/s", flush=True)
    base, lora = statistics.median(results["base"]), statistics.median(results["lora"])
    print(f"median: base {base:.1f}, lora {lora:.1f} output tok/s: {lora / base:.2f}x")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run("lora")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
