"""``pagedllm bench throughput``: offline throughput, as ``vllm bench throughput``.

All requests are handed to the engine at once (``LLM.generate``); the wall time of that
call (prefill included) gives requests/s, output tokens/s and total tokens/s.

``--backend hf`` runs the same prompts through transformers' ``generate`` in static
batches of ``--hf-max-batch-size`` (left padding, greedy, ``min_new_tokens =
max_new_tokens`` with ``--ignore-eos``): the floor. ``--compare hf`` runs pagedllm and then
transformers in one invocation and prints the ratio. Only the tokens a request asked for
are counted for transformers (a static batch generates up to its longest request).

Example::

    pagedllm bench throughput --model DIR --dtype bfloat16 --num-prompts 32 \\
        --input-len 128 --output-len 128 --ignore-eos --compare hf --hf-max-batch-size 32

Multi-LoRA (vLLM's ``--lora-path``): with ``--enable-lora --lora-path ADAPTER``, request i
runs adapter ``i % --num-loras + 1``, each a distinct adapter id over the same files (as
vLLM's benchmark does), so the batch mixes ``--num-loras`` adapters uniformly; the result
adds ``lora_load_time_s`` (reading and checking the adapter, median of 3). Random adapters
for a checkpoint: ``python -m pagedllm.benchmarks.lora_adapters MODEL OUT_DIR --rank 16``.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any, Optional

from pagedllm.benchmarks import comm_stats, machine_info, set_num_threads, write_json
from pagedllm.benchmarks.datasets import (
    SampleRequest,
    add_dataset_args,
    dataset_description,
    get_samples,
    random_dataset,
)
from pagedllm.config.engine_args import add_engine_args, given_engine_kwargs

BACKENDS = ("pagedllm", "hf")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``pagedllm serve``'s engine flags (``add_engine_args``: the same names, types and
    choices) and ``--num-threads``, for the offline benchmarks. A flag left unset keeps
    ``LLM``'s default; ``--dtype`` (default auto) and ``--seed`` (default 0; also the
    dataset's) are always passed."""
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    add_engine_args(parser, {"engine": parser.add_argument_group("engine (pagedllm backend)")}, unset=True)
    parser.set_defaults(dtype="auto", seed=0)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments from the engine flags that were given (and ``dtype``,
    ``seed``)."""
    return given_engine_kwargs(args)


def build_llm(args: argparse.Namespace):
    """(LLM, seconds its construction took)."""
    from pagedllm.entrypoints.llm import LLM

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    return llm, time.perf_counter() - start


def load_tokenizer(args: argparse.Namespace):
    from pagedllm.config import resolve_model_path
    from pagedllm.tokenizer import get_tokenizer

    return get_tokenizer(resolve_model_path(args.tokenizer or args.model))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    add_dataset_args(parser, default_input_len=1024, default_output_len=128, seed=False)
    parser.add_argument("--backend", default="pagedllm", choices=BACKENDS)
    parser.add_argument("--compare", default=None, choices=["hf"],
                        help="also run this backend on the same prompts and print the ratio")
    parser.add_argument("--hf-max-batch-size", type=int, default=None,
                        help="hf backend: static batch size (default: all prompts in one batch)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="pagedllm: produce token ids only (no text)")
    parser.add_argument("--num-warmups", type=int, default=1,
                        help="untimed warm-up generate calls (a short random prompt, 4 tokens) before the run")
    parser.add_argument("--output-json", default=None, help="write the results to this JSON file")
    parser.add_argument("--lora-path", default=None,
                        help="pagedllm: a PEFT LoRA adapter folder; requests use it as --num-loras adapters")
    parser.add_argument("--num-loras", type=int, default=None,
                        help="distinct adapters mixed uniformly over the requests (default: --max-loras, else 1)")


def lora_requests(args: argparse.Namespace, num_requests: int) -> Optional[list]:
    """One ``LoRARequest`` per request (``--lora-path``: adapter ids 1 .. --num-loras in
    turn), or None without ``--lora-path``."""
    if not getattr(args, "lora_path", None):
        return None
    from pagedllm.lora.request import LoRARequest

    num_loras = args.num_loras or args.max_loras or 1
    return [LoRARequest(f"lora-{i % num_loras + 1}", i % num_loras + 1, args.lora_path) for i in range(num_requests)]


def lora_load_time(llm: Any, args: argparse.Namespace) -> float:
    """Seconds to read and check ``--lora-path`` (median of 3 loads)."""
    from pagedllm.lora.adapter import load_adapter
    from pagedllm.lora.request import LoRARequest

    config = llm.llm_engine.config
    times = []
    for _ in range(3):
        start = time.perf_counter()
        load_adapter(LoRARequest("load-time", 1, args.lora_path), config.model_config.hf_config,
                     config.lora_config.max_lora_rank)
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def _result(backend: str, args: argparse.Namespace, requests: list[SampleRequest], elapsed: float,
            output_lens: list[int], init_time: float, extra: Optional[dict] = None) -> dict[str, Any]:
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(output_lens)
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "backend": backend,
        "model": args.model,
        "dtype": args.dtype,
        **dataset_description(args),
        "num_requests": len(requests),
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "elapsed_time": elapsed,
        "init_time_s": init_time,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "input_lens": [r.prompt_len for r in requests],
        "output_lens": list(output_lens),
        "machine": machine_info(),
    }
    result.update(extra or {})
    return result


def run_pagedllm(args: argparse.Namespace, requests: Optional[list[SampleRequest]] = None,
                 llm: Any = None) -> dict[str, Any]:
    """Time ``LLM.generate`` over the dataset; returns the result dict."""
    from pagedllm.sampling_params import SamplingParams

    init_time = 0.0
    if llm is None:
        llm, init_time = build_llm(args)
    tokenizer = llm.get_tokenizer()
    if requests is None:
        requests = get_samples(args, tokenizer)

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(n=1, temperature=args.temperature, top_p=1.0, ignore_eos=args.ignore_eos,
                              max_tokens=max_tokens, detokenize=not args.disable_detokenize)

    for i in range(args.num_warmups):
        warm = random_dataset(tokenizer, 1, 16, 4, seed=10_000 + i)[0]
        llm.generate([{"prompt_token_ids": warm.prompt_token_ids}], params(4), use_tqdm=False)
    if args.num_warmups:
        try:
            llm.reset_prefix_cache()
        except (AttributeError, RuntimeError):
            pass
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    sampling = [params(r.expected_output_len) for r in requests]
    loras = lora_requests(args, len(requests))
    comm_stats.reset(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    output_lens = [len(o.outputs[0].token_ids) for o in outputs]
    extra: dict[str, Any] = {
        "engine_args": {k: v for k, v in engine_kwargs(args).items() if k not in ("model", "tokenizer")}
    }
    tp_stats = comm_stats.collect(llm, elapsed)
    if tp_stats is not None:
        extra["tensor_parallel_comm"] = tp_stats
    if loras is not None:
        extra.update(lora_path=args.lora_path, num_loras=len({r.lora_int_id for r in loras}),
                     lora_load_time_s=lora_load_time(llm, args))
    return _result("pagedllm", args, requests, elapsed, output_lens, init_time, extra)


def hf_batches(requests: list[SampleRequest], max_batch_size: Optional[int]) -> list[list[int]]:
    """Indices of the static batches (in request order)."""
    size = max_batch_size or len(requests)
    return [list(range(i, min(i + size, len(requests)))) for i in range(0, len(requests), size)]


def run_hf(args: argparse.Namespace, requests: list[SampleRequest]) -> dict[str, Any]:
    """transformers ``generate`` in static left-padded batches, greedy (or sampled at
    ``--temperature``); counts each request's own tokens up to its output length / EOS."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.config import resolve_model_path
    from pagedllm.platforms import current_platform

    path = resolve_model_path(args.model)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = dtypes.get(args.dtype, "auto")
    start = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    model.to(current_platform.device).eval()
    init_time = time.perf_counter() - start
    tokenizer = load_tokenizer(args)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    batches = hf_batches(requests, args.hf_max_batch_size)

    def generate(batch: list[SampleRequest]) -> list[int]:
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[row, width - r.prompt_len:] = 1
        new = max(r.expected_output_len for r in batch)
        kwargs: dict[str, Any] = dict(max_new_tokens=new, pad_token_id=pad, use_cache=True)
        if args.temperature > 0:
            kwargs.update(do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if args.ignore_eos:
            kwargs["min_new_tokens"] = new
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), **kwargs)
        gen = out[:, width:].tolist()
        lens = []
        for row, r in enumerate(batch):
            tokens = gen[row][: r.expected_output_len]
            if not args.ignore_eos and eos is not None and eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]
            lens.append(len(tokens))
        return lens

    for _ in range(args.num_warmups):
        warm = random_dataset(tokenizer, 1, 16, 4, seed=10_000)[0]
        generate([warm])
    output_lens = [0] * len(requests)
    start = time.perf_counter()
    for batch in batches:
        for index, n in zip(batch, generate([requests[i] for i in batch])):
            output_lens[index] = n
    elapsed = time.perf_counter() - start
    extra = {"hf_max_batch_size": args.hf_max_batch_size or len(requests), "num_batches": len(batches)}
    result = _result("hf", args, requests, elapsed, output_lens, init_time, extra)
    del model
    gc.collect()
    return result


def print_result(result: dict[str, Any]) -> None:
    m = result.get("machine", {})
    if "cpu_isa" in m:
        print(f"[{result['backend']}] CPU ISA {m['cpu_isa']}" + (f" (run at {m['cpu_isa_override']})" if m["cpu_isa_override"] else ""))
    print(f"[{result['backend']}] Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"[{result['backend']}] Total num prompt tokens: {result['total_prompt_tokens']}, "
          f"total num output tokens: {result['total_output_tokens']}, "
          f"elapsed {result['elapsed_time']:.2f} s (start-up {result['init_time_s']:.2f} s)")
    if "num_loras" in result:
        print(f"[{result['backend']}] {result['num_loras']} LoRA adapters mixed; "
              f"adapter load time {result['lora_load_time_s'] * 1000:.1f} ms")
    comm_stats.print_stats(result.get("tensor_parallel_comm"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark that ``args`` describes; returns the (top-level) result dict."""
    set_num_threads(args.num_threads)
    if args.backend == "hf" and args.compare == "hf":
        args.compare = None
    requests = get_samples(args, load_tokenizer(args))
    if args.backend == "pagedllm":
        result = run_pagedllm(args, requests)
        if args.compare == "hf":
            gc.collect()
            hf = run_hf(args, requests)
            ratio = result["output_tokens_per_second"] / hf["output_tokens_per_second"]
            result["compare"] = {
                "hf": hf,
                "ratio_output_tokens_per_second": ratio,
                "ratio_tokens_per_second": result["tokens_per_second"] / hf["tokens_per_second"],
            }
        print_result(result)
        if "compare" in result:
            print_result(result["compare"]["hf"])
            print(f"pagedllm / hf output tokens/s: {result['compare']['ratio_output_tokens_per_second']:.2f}x")
    else:
        result = run_hf(args, requests)
        print_result(result)
    return result


def main(args: argparse.Namespace) -> int:
    result = run(args)
    write_json(args.output_json, result)
    if args.output_json:
        print(f"Results written to {args.output_json}")
    return 0
