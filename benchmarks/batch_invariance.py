"""What ``--batch-invariant`` removes and what it costs, on one model, in one process.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/batch_invariance.py \\
        --model pagedllm/assets/pagedllm-default --num-prompts 8 --input-len 128 --output-len 32

Drift: for each mode (default, batch-invariant), the same greedy requests (random prompts of
``--input-len`` tokens, half of them sharing their first half) run three ways — each alone
with prefix caching off and the whole prompt in one step; all together in 16-token steps;
and all together again, their starts now cached — and the script prints, per way, the
largest and the median |difference| of the generated tokens' logprobs from the alone run
(tokens compared position by position while the greedy tokens agree), and how many
requests' greedy tokens differ.

Speed: the same batch, all together with the default step budget, timed in both modes
alternately for ``--rounds`` rounds (A, B, A, B ...: a loaded machine's noise falls on
both), with prefix caching off; prints each mode's median time of the prefill-only run
(``max_tokens`` 1), of the whole run, and of a decode-bound run (the same number of
8-token prompts, ``--output-len`` tokens each), and the batch-invariant / default ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm import LLM, SamplingParams


def _prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(length // 2)]
    prompts = []
    for i in range(num):
        tail = [rng.randrange(3, vocab) for _ in range(length - len(shared))]
        prompts.append(shared + tail if i % 2 else [rng.randrange(3, vocab) for _ in range(length)])
    return prompts


def _generate(llm: LLM, prompts, params) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outputs]  # fmt: skip


def _drift(reference, got) -> tuple[float, float, int]:
    """(largest, median |d logprob| over the tokens compared, requests whose tokens differ)."""
    diffs, differ = [], 0
    for (ref_tokens, ref_lps), (tokens, lps) in zip(reference, got):
        differ += tokens != ref_tokens
        for a, b, ta, tb in zip(ref_lps, lps, ref_tokens, tokens):
            diffs.append(abs(a - b))
            if ta != tb:
                break
    return max(diffs), statistics.median(diffs), differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the shipped model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    common = dict(dtype=args.dtype, kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=1)
    engines = {}
    for mode, invariant in (("default", False), ("batch-invariant", True)):
        alone_llm = LLM(args.model, enable_prefix_caching=False, batch_invariant=invariant, **common)
        prompts = _prompts(args.num_prompts, args.input_len, alone_llm.get_tokenizer().vocab_size)
        alone = [_generate(alone_llm, [p], params)[0] for p in prompts]
        del alone_llm
        batched_llm = LLM(args.model, max_num_batched_tokens=16, batch_invariant=invariant, **common)
        cold, warm = _generate(batched_llm, prompts, params), _generate(batched_llm, prompts, params)
        del batched_llm
        for way, got in (("together, 16-token steps", cold), ("together again, starts cached", warm)):
            largest, median, differ = _drift(alone, got)
            print(f"{mode:16s} {way:32s} max |d logprob| {largest:.4g}  median {median:.3g}  "
                  f"requests with other tokens {differ}/{len(prompts)}")
        engines[mode] = LLM(args.model, enable_prefix_caching=False, batch_invariant=invariant, **common)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    whole = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    short = [p[:8] for p in prompts]
    runs = {
        "prefill": (prompts, prefill, f"{args.num_prompts} x {args.input_len}"),
        "whole": (prompts, whole, f"{args.num_prompts} x {args.input_len} + {args.output_len} out"),
        "decode": (short, whole, f"{args.num_prompts} x 8 + {args.output_len} out"),
    }
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            for name, (batch, p, _) in runs.items():
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": q} for q in batch], p, use_tqdm=False)
                times.setdefault((mode, name), []).append(time.perf_counter() - start)
    for name, (_, _, what) in runs.items():
        base, inv = (statistics.median(times[(m, name)]) for m in ("default", "batch-invariant"))
        print(f"{name:8s} {what}: default {base:.3f} s, batch-invariant {inv:.3f} s, ratio {inv / base:.2f}x")


if __name__ == "__main__":
    main()
