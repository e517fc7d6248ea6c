"""``pagedllm snapshot create NAME [serve flags] | create NAME --url URL [--api-key KEY] [more serve
flags] | restore NAME [serve flags] | list | delete NAME`` (``pagedllm.snapshot.snapshots``)."""

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
        "create NAME --url URL [--api-key KEY] [more serve flags]: snapshot the pagedllm server running at URL "
        "(its flags and the LoRA adapters it serves now; run it where the server's files are); "
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
            print(_create(args.name, args.serve_args))
        elif args.action == "delete":
            snapshots.delete(args.name)
        else:
            argv, env, cwd = snapshots.restore_command(args.name)
            from pagedllm.preload.fork_server import serve_forked

            # a preload daemon of this environment (PAGEDLLM_PRELOAD_DIR) forks the server, if one runs
            code = serve_forked([*argv, *args.serve_args], env, cwd)
            if code is not None:
                return code
            os.chdir(cwd)
            os.execve(sys.executable, [sys.executable, "-m", "pagedllm.entrypoints.cli", *argv, *args.serve_args], env)
    except (ValueError, OSError) as exc:
        print(f"pagedllm snapshot: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


def _create(name: str, serve_args: list[str]) -> Any:
    """``create`` of the flags, or with ``--url`` (``--url=``) among them, ``create_from_url``
    (``--api-key``: the key to ask it with)."""
    from pagedllm.snapshot import snapshots

    if not any(arg == "--url" or arg.startswith("--url=") for arg in serve_args):
        return snapshots.create(name, serve_args)
    parser = argparse.ArgumentParser(prog=f"pagedllm snapshot create {name}", add_help=False, allow_abbrev=False)
    parser.add_argument("--url", required=True)
    parser.add_argument("--api-key")
    url_args, more = parser.parse_known_args(serve_args)
    return snapshots.create_from_url(name, url_args.url, url_args.api_key, more)
