"""``pagedllm bench perplexity``: a model's perplexity on a text file, from the engine's
prompt logprobs (vLLM has no such benchmark; this one follows llama.cpp's
``llama-perplexity`` so that the two can be compared on the same tokens).

The file (``--dataset-path``) is tokenized whole, as a prompt (the tokenizer's BOS, if it adds
one, at the start), and cut into consecutive, non-overlapping windows of ``--context-size``
tokens; the tail that does not fill a window is dropped, ``--num-chunks`` keeps the first N.
Each window is one prompt with ``prompt_logprobs=0`` and ``max_tokens=1`` (all windows are
sent at once): the engine returns log p(token i | tokens 0..i-1 of the window) for every
position i >= 1, computed by the engine's own model, quantization and KV cache.

Scored tokens (``--scored-tokens``):

* ``second-half`` (default), llama-perplexity's rule: of a window of n tokens, tokens
  n/2 + 1 .. n - 1 (n/2 - 1 tokens, each seeing at least n/2 tokens of context). When the
  tokenizer adds a BOS, each window's first token is replaced by BOS, as llama-perplexity does.
* ``all``: tokens 1 .. n - 1 of every window.

Reported: perplexity = exp(mean NLL) over every scored token, and llama-perplexity's
"+/-" (perplexity x the standard error of the mean NLL), with the token counts.

Example (the shipped model on its held-out text, llama-perplexity's ``-c 256``)::

    python tools/train_default_model.py --write-heldout-text /tmp/heldout.txt
    pagedllm bench perplexity --dataset-path /tmp/heldout.txt --context-size 256 --quantization int8
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pagedllm.benchmarks import machine_info, set_num_threads, write_json
from pagedllm.benchmarks.throughput import add_model_args, build_llm

SCORED_TOKENS = ("second-half", "all")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--dataset-path", required=True, help="UTF-8 text file to score")
    parser.add_argument("--context-size", "-c", type=int, default=512,
                        help="tokens per window (llama-perplexity's -c); default 512")
    parser.add_argument("--scored-tokens", default="second-half", choices=SCORED_TOKENS,
                        help="which tokens of each window count: the second half (llama-perplexity's rule, "
                        "default) or all but the first")
    parser.add_argument("--num-chunks", type=int, default=None,
                        help="score only the first N windows (llama-perplexity's --chunks)")
    parser.add_argument("--output-json", default=None)


@dataclass(frozen=True)
class Windows:
    """The windows of a tokenized text and which of their positions are scored.

    Attributes:
        token_ids: one list of ``context_size`` token ids per window.
        first_scored: index of the first scored position in each window (>= 1).
    """

    token_ids: list[list[int]]
    first_scored: int


def make_windows(ids: Sequence[int], context_size: int, scored_tokens: str, bos_token_id: Optional[int],
                 num_chunks: Optional[int] = None) -> Windows:
    """Cut ``ids`` into whole windows (see the module docstring).

    Args:
        ids: the text's token ids, as the tokenizer encodes a prompt.
        context_size: tokens per window, at least 4 (two scored tokens in the second half).
        scored_tokens: ``"second-half"`` or ``"all"``.
        bos_token_id: the BOS id when the tokenizer adds one (then each window starts with
            it, in the second-half rule), else None.
        num_chunks: keep only the first N windows.

    Raises:
        ValueError: a context below 4, an unknown rule, or a text shorter than two windows
            (llama-perplexity's minimum).
    """
    if context_size < 4:
        raise ValueError(f"--context-size must be at least 4, got {context_size}")
    if scored_tokens not in SCORED_TOKENS:
        raise ValueError(f"--scored-tokens must be one of {SCORED_TOKENS}, got {scored_tokens!r}")
    if len(ids) < 2 * context_size:
        raise ValueError(f"the text has {len(ids)} tokens; a context of {context_size} needs at least "
                         f"{2 * context_size} (two windows)")
    count = len(ids) // context_size
    if num_chunks is not None:
        count = min(count, num_chunks)
    windows = [list(ids[i * context_size:(i + 1) * context_size]) for i in range(count)]
    if scored_tokens == "second-half":
        if bos_token_id is not None:
            for window in windows:
                window[0] = bos_token_id
        return Windows(windows, context_size // 2 + 1)
    return Windows(windows, 1)


def summarize_nll(nlls: Sequence[float]) -> dict[str, float]:
    """``perplexity`` = exp(mean), ``perplexity_error`` = perplexity x sqrt(var / (n - 1))
    (llama-perplexity's "+/-"), ``mean_nll`` (nats per token), ``num_scored_tokens``."""
    n = len(nlls)
    mean = sum(nlls) / n
    var = sum(x * x for x in nlls) / n - mean * mean
    ppl = math.exp(mean)
    err = ppl * math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0
    return {"perplexity": ppl, "perplexity_error": err, "mean_nll": mean, "num_scored_tokens": n}


def scored_nlls(llm: Any, windows: Windows) -> list[float]:
    """Negative log-likelihoods (nats) of every scored token of every window, in order,
    from one ``generate`` call with ``prompt_logprobs=0``."""
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    prompts = [{"prompt_token_ids": w} for w in windows.token_ids]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    nlls: list[float] = []
    for window, output in zip(windows.token_ids, outputs):
        logprobs = output.prompt_logprobs
        for i in range(windows.first_scored, len(window)):
            nlls.append(-logprobs[i][window[i]].logprob)
    return nlls


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, score the file; the result dict (see the module docstring)."""
    set_num_threads(args.num_threads)
    with open(args.dataset_path, encoding="utf-8") as f:
        text = f.read()
    llm, _ = build_llm(args)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer(text, verbose=False)["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and len(ids) > 0 and ids[0] == bos
    windows = make_windows(ids, args.context_size, args.scored_tokens, bos if adds_bos else None,
                           args.num_chunks)
    start = time.perf_counter()
    nlls = scored_nlls(llm, windows)
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = summarize_nll(nlls)
    result.update(
        benchmark="perplexity", model=args.model, dtype=args.dtype, quantization=args.quantization,
        quantization_config=args.quantization_config,
        kv_cache_dtype=args.kv_cache_dtype or "auto", dataset_path=args.dataset_path,
        num_text_tokens=len(ids), context_size=args.context_size, scored_tokens=args.scored_tokens,
        num_chunks=len(windows.token_ids), bos_replaced=adds_bos and args.scored_tokens == "second-half",
        elapsed_s=elapsed, machine=machine_info(),
    )
    return result


def main(args: argparse.Namespace) -> int:
    r = run(args)
    print(f"perplexity: {r['perplexity']:.4f} +/- {r['perplexity_error']:.4f} "
          f"(mean NLL {r['mean_nll']:.5f} nats over {r['num_scored_tokens']:,} tokens; "
          f"{r['num_chunks']} windows of {r['context_size']} tokens, {r['scored_tokens']} scored; "
          f"{r['num_text_tokens']:,} text tokens; {r['elapsed_s']:.1f} s)")
    write_json(args.output_json, r)
    return 0
