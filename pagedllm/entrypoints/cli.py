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
import importlib
import sys
from typing import Optional, Sequence

from pagedllm.version import __version__

#: Each subcommand, in ``--help``'s order, and the module whose ``register`` adds it.
SUBCOMMANDS = {
    "serve": "pagedllm.entrypoints.openai.cli_args",
    "run-batch": "pagedllm.entrypoints.openai.run_batch",
    "bench": "pagedllm.benchmarks.cli",
    "chat": "pagedllm.entrypoints.client_cli",
    "complete": "pagedllm.entrypoints.client_cli",
    "router": "pagedllm.entrypoints.router",
    "preload": "pagedllm.preload.cli",
    "snapshot": "pagedllm.snapshot.cli",
}


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The ``pagedllm`` parser with every subcommand, or with ``command``'s alone (a name of
    ``SUBCOMMANDS``): ``pagedllm serve`` then neither imports the benchmarks (numpy) nor
    builds their parsers."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: fast LLM inference and serving.")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = [SUBCOMMANDS[command]] if command in SUBCOMMANDS else SUBCOMMANDS.values()
    for module in dict.fromkeys(modules):
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    args.command_line = argv  # `pagedllm serve` reports its flags (GET /server_info)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
