"""``pagedllm bench throughput|latency|serve|prefix-caching|roofline|startup|grammar-compile|perplexity``.

``register(subparsers)`` adds the ``bench`` parser to the ``pagedllm`` command (see
``pagedllm/entrypoints/cli.py``); each sub-subcommand sets ``func(args) -> int``.
``python -m pagedllm.benchmarks.cli throughput ...`` runs the same without the top-level
command.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional, Sequence

from pagedllm.benchmarks import grammar_compile, latency, perplexity, prefix_caching, roofline, serve, startup, throughput

SUBCOMMANDS: dict[str, tuple[Any, str]] = {
    "throughput": (throughput, "offline throughput (all requests at once), optionally against transformers"),
    "latency": (latency, "one batch: prefill time and per-token decode latency"),
    "serve": (serve, "load generator for an OpenAI-compatible server (TTFT, TPOT, ITL, E2E)"),
    "prefix-caching": (prefix_caching, "TTFT and throughput with automatic prefix caching off vs on"),
    "roofline": (roofline, "this machine's matmul and memory limits for a model; MFU / MBU of a result"),
    "startup": (startup, "seconds from process start until `pagedllm serve` / `LLM(...)` is ready"),
    "grammar-compile": (grammar_compile, "structured outputs: a JSON schema's compile time, cold and cached"),
    "perplexity": (perplexity, "perplexity of a text file from prompt logprobs (llama-perplexity's windows)"),
}


def _entry(module: Any) -> Callable[[argparse.Namespace], int]:
    def func(args: argparse.Namespace) -> int:
        return int(module.main(args) or 0)

    return func


def add_bench_subcommands(bench: argparse.ArgumentParser) -> None:
    subs = bench.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        doc = (module.__doc__ or help_text).strip()
        sub = subs.add_parser(name, help=help_text, description=doc,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_cli_args(sub)
        sub.set_defaults(func=_entry(module))


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` (with its sub-subcommands) to the ``pagedllm`` command's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(SUBCOMMANDS),
                                  description="Benchmarks with vLLM's flag names.")
    add_bench_subcommands(bench)
    return bench


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm bench", description="Benchmarks with vLLM's flag names.")
    add_bench_subcommands(parser)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
