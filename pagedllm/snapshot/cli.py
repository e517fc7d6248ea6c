"""``pagedllm snapshot create NAME [serve flags] | restore NAME [serve flags] | list | delete NAME``
(``pagedllm.snapshot.snapshots``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``snapshot`` to the ``pagedllm`` command (sets ``func`` to ``main``)."""
    parser = subparsers.add_parser(
        "snapshot", help="Save a server's configuration, LoRA adapters and loaded weights; serve them again.",
        description="create NAME [serve flags]: snapshot what `pagedllm serve [serve flags]` would serve; "
        "restore NAME [more serve flags]: serve it (the weights mapped, not loaded); list; delete NAME. "
        "Snapshots live in PAGEDLLM_SNAPSHOT_DIR.",
    )  # fmt: skip
    parser.add_argument("action", choices=("create", "restore", "list", "delete"))
    parser.add_argument("name", nargs="?", help="the snapshot's name (create, restore, delete)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="`pagedllm serve` flags (create, restore)")
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the action; exit code 2 for a bad name or flags (one line on stderr)."""
    from pagedllm.snapshot import snapshots

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        if args.action == "list":
            print(json.dumps(snapshots.list_snapshots(), indent=1))
            return 0
        if not args.name:
            raise ValueError(f"`pagedllm snapshot {args.action}` needs a NAME.")
        if args.action == "create":
            print(snapshots.create(args.name, args.serve_args))
        elif args.action == "delete":
            snapshots.delete(args.name)
        else:
            argv, env = snapshots.restore_command(args.name)
            os.execve(sys.executable, [sys.executable, "-m", "pagedllm.entrypoints.cli", *argv, *args.serve_args], env)
    except ValueError as exc:
        print(f"pagedllm snapshot: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0
