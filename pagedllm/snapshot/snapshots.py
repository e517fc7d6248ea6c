"""Create, find, list and delete snapshots (see the package docstring).

A snapshot folder holds ``snapshot.json`` (``serve_args``: the ``pagedllm serve`` flags it was
made from; ``adapters``: LoRA name -> folder under ``adapters/``; the model and the time),
``adapters/<name>/`` and ``weights/`` (a ``PAGEDLLM_PRELOAD_DIR`` with the model's store).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm import envs

META_FILE = "snapshot.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def snapshot_root() -> Path:
    """The folder of the snapshots (``PAGEDLLM_SNAPSHOT_DIR``)."""
    return Path(envs.PAGEDLLM_SNAPSHOT_DIR.get()).expanduser()


def snapshot_dir(name: str) -> Path:
    """The folder of snapshot ``name``.

    Raises:
        ValueError: a name that is not letters, digits, '.', '_' and '-'.
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"Snapshot name {name!r}: use letters, digits, '.', '_' and '-'.")
    return snapshot_root() / name


def _serve_args(serve_argv: list[str]) -> argparse.Namespace:
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    parser = argparse.ArgumentParser(prog="pagedllm snapshot create NAME")
    make_arg_parser(parser)
    args = parser.parse_args(serve_argv)
    args.model = args.model_tag or args.model
    return args


def create(name: str, serve_argv: list[str]) -> Path:
    """Snapshot the server that ``pagedllm serve <serve_argv>`` starts: its flags, copies of
    its LoRA adapters and its loaded weights; returns the snapshot's folder.

    Raises:
        ValueError: a bad name, a snapshot of that name already there, bad flags, or a
            model that cannot be preloaded (``preload_model``).
    """
    from pagedllm.entrypoints.openai.cli_args import engine_args_from
    from pagedllm.preload.daemon import preload_model

    directory = snapshot_dir(name)
    if directory.exists():
        raise ValueError(f"Snapshot {name!r} exists ({directory}); delete it first.")
    args = _serve_args(serve_argv)
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    engine_args = engine_args_from(args)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=directory.parent))
    try:
        adapters = {}
        for module in args.lora_modules or []:
            shutil.copytree(module["path"], staging / "adapters" / module["name"])
            adapters[module["name"]] = f"adapters/{module['name']}"
        preload_model(engine_args, staging / "weights")
        meta = {"name": name, "created": time.time(), "model": str(args.model), "serve_args": serve_argv,
                "adapters": adapters}
        (staging / META_FILE).write_text(json.dumps(meta, indent=1))
        os.rename(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def restore_command(name: str) -> tuple[list[str], dict[str, str]]:
    """The ``pagedllm`` arguments and the environment that serve snapshot ``name``:
    ``serve <its flags> --load-format ipc_cache [--lora-modules <its copies>]``.

    Raises:
        ValueError: no snapshot of that name.
    """
    directory = snapshot_dir(name)
    if not (directory / META_FILE).exists():
        raise ValueError(f"No snapshot {name!r} in {snapshot_root()}; `pagedllm snapshot list` lists them.")
    meta = json.loads((directory / META_FILE).read_text())
    argv = ["serve", *meta["serve_args"], "--load-format", "ipc_cache"]
    if meta["adapters"]:
        argv += ["--lora-modules", *(f"{n}={directory / path}" for n, path in meta["adapters"].items())]
    return argv, {**os.environ, "PAGEDLLM_PRELOAD_DIR": str(directory / "weights")}


def list_snapshots() -> list[dict[str, Any]]:
    """Every snapshot: name, model, creation time, size (bytes) and flags."""
    root = snapshot_root()
    found = []
    for directory in sorted(root.iterdir()) if root.exists() else []:
        if (directory / META_FILE).exists():
            meta = json.loads((directory / META_FILE).read_text())
            size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
            found.append({**meta, "nbytes": size})
    return found


def delete(name: str) -> None:
    """Delete snapshot ``name`` (a server restored from it serves on: its mapping stays).

    Raises:
        ValueError: no snapshot of that name.
    """
    directory = snapshot_dir(name)
    if not (directory / META_FILE).exists():
        raise ValueError(f"No snapshot {name!r} in {snapshot_root()}.")
    shutil.rmtree(directory)
