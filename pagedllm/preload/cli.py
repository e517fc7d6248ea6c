"""``pagedllm preload``: ``pagedllm preload MODEL [engine flags]`` preloads a model and runs the
daemon (or adds the store to the running one); ``--list``, ``--status``, ``--evict MODEL``,
``--stop`` ask the running daemon (``pagedllm.preload.daemon``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from pagedllm.config.engine_args import EngineArgs, add_engine_args


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``preload`` to the ``pagedllm`` command (sets ``func`` to ``main``)."""
    parser = subparsers.add_parser(
        "preload", usage="%(prog)s [MODEL] [engine flags] | --list | --status | --evict MODEL | --stop",
        help="Hold a model's loaded weights in shared memory for `serve --load-format ipc_cache`.",
        description="Load MODEL as `pagedllm serve MODEL [engine flags]` would, after every load-time "
        "transformation, keep it in shared memory (PAGEDLLM_PRELOAD_DIR) and answer on its control socket "
        "until --stop. `pagedllm serve MODEL --load-format ipc_cache [same flags]` then maps it.",
    )  # fmt: skip
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="The model to preload.")
    control = parser.add_mutually_exclusive_group()
    control.add_argument("--list", action="store_true", help="List the running daemon's stores (JSON).")
    control.add_argument("--status", action="store_true", help="The running daemon's pid, uptime and size (JSON).")
    control.add_argument("--evict", metavar="MODEL", help="Delete the stores of MODEL (mapped ones serve on).")
    control.add_argument("--stop", action="store_true", help="Stop the daemon; it deletes its stores.")
    add_engine_args(parser)
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the command; exit codes: 0, 1 (no daemon answers a control request), 2 (bad arguments)."""
    from pagedllm.preload import daemon
    from pagedllm.preload.ipc_cache import preload_root

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    root = preload_root()
    asked = [op for op in ("list", "status", "stop") if getattr(args, op)] + (["evict"] if args.evict else [])
    if asked:
        reply = daemon.control(root, asked[0], **({"model": args.evict} if args.evict else {}))
        if reply is None:
            print(f"pagedllm preload: no daemon answers on {root / daemon.SOCKET_NAME}", file=sys.stderr)
            return 1
        print(json.dumps(reply, indent=1))
        return 0
    args.model = args.model_tag or args.model
    try:
        engine_args = EngineArgs.from_cli_args(args)
        running = daemon.control(root, "status")
        daemon.preload_model(engine_args)
    except ValueError as exc:
        print(f"pagedllm preload: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if running is not None:
        print(f"pagedllm preload: added to the daemon running as pid {running['pid']}", file=sys.stderr)
        return 0
    warm_up()
    print(f"pagedllm preload: ready; control socket {root / daemon.SOCKET_NAME}", file=sys.stderr, flush=True)
    daemon.serve_control(root, run_server=run_server)
    return 0


#: What a server imports after the configuration (which the preload resolved already): the
#: daemon imports them once, and every server it forks inherits them.
SERVER_MODULES = ("uvicorn", "pagedllm.engine.async_llm", "pagedllm.engine.core", "pagedllm.engine.client_factory",
                  "pagedllm.entrypoints.openai.api_server", "pagedllm.entrypoints.openai.launcher",
                  "pagedllm.entrypoints.chat_utils", "pagedllm.worker.worker")


def warm_up() -> None:
    """Import ``SERVER_MODULES`` (for the servers this daemon forks: ``fork_server``)."""
    import importlib

    for module in SERVER_MODULES:
        importlib.import_module(module)


def run_server(argv: list[str]) -> int:
    """``pagedllm <argv>`` (``serve ...``) in a server forked by the daemon; its exit code."""
    from pagedllm.entrypoints.openai.cli_args import main as serve_main, serve_parser

    if not argv or argv[0] != "serve":
        raise ValueError(f"the preload daemon forks `pagedllm serve` only, not {argv[:1]}")
    args = serve_parser().parse_args(argv[1:])
    args.command_line = argv
    args.forked_by_daemon = True
    return serve_main(args)
