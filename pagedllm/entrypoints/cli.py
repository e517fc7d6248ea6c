"""The ``pagedllm`` command: ``pagedllm serve``, ``pagedllm run-batch``, ``pagedllm bench ...``,
``pagedllm chat``, ``pagedllm complete``, ``pagedllm router``, ``pagedllm preload`` and
``pagedllm snapshot``.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments, returning an exit code). This module is the top
floor (``tests/test_import_layers.py``): the benchmarks it dispatches to import the rest of
``entrypoints`` (``LLM``, flag types), which imports nothing of ``benchmarks``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from pagedllm.version import __version__


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.benchmarks import cli as bench_cli
    from pagedllm.entrypoints import client_cli, router
    from pagedllm.entrypoints.openai import cli_args as serve_cli
    from pagedllm.entrypoints.openai import run_batch as run_batch_cli
    from pagedllm.preload import cli as preload_cli
    from pagedllm.snapshot import cli as snapshot_cli

    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: fast LLM inference and serving.")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    serve_cli.register(subparsers)
    run_batch_cli.register(subparsers)
    bench_cli.register(subparsers)
    client_cli.register(subparsers)
    router.register(subparsers)
    preload_cli.register(subparsers)
    snapshot_cli.register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
