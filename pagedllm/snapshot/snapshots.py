"""Create, find, list and delete snapshots (see the package docstring).

A snapshot folder holds ``snapshot.json`` (``serve_args``: the ``pagedllm serve`` flags it was
made from; ``cwd``: the folder they are relative to, where ``restore`` starts the server;
``adapters``: LoRA name -> ``{"path": folder under adapters/, "base_model_name"}``; the model
and the time), ``adapters/<name>/`` and ``weights/`` (a ``PAGEDLLM_PRELOAD_DIR`` with the
model's store).

``create_from_url`` snapshots a running server (vLLM's seeds capture a fully initialised
one): the flags and adapters its ``GET /server_info`` reports (``pagedllm.entrypoints.openai.
server_info``) make the snapshot ``create`` makes of the same flags. It runs where the
server's files are (its model folder and adapters, as the server's paths name them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from pagedllm import envs

META_FILE = "snapshot.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: Seconds ``create_from_url`` waits for the server's ``/server_info``.
SERVER_INFO_TIMEOUT_S = 30.0


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


def create(name: str, serve_argv: list[str], cwd: Optional[str] = None) -> Path:
    """Snapshot the server that ``pagedllm serve <serve_argv>``, run in the folder ``cwd`` (None:
    this process's), starts: its flags, copies of its LoRA adapters and its loaded weights;
    returns the snapshot's folder.

    Raises:
        ValueError: a bad name, a snapshot of that name already there, bad flags, or a
            model that cannot be preloaded (``preload_model``).
    """
    from pagedllm.entrypoints.openai.cli_args import engine_args_from
    from pagedllm.preload.daemon import preload_model

    directory = snapshot_dir(name).absolute()
    if directory.exists():
        raise ValueError(f"Snapshot {name!r} exists ({directory}); delete it first.")
    cwd = os.path.abspath(cwd or os.getcwd())
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=directory.parent))
    try:
        with contextlib.chdir(cwd):  # the flags' relative paths are the server's
            args = _serve_args(serve_argv)
            if args.lora_modules and not args.enable_lora:
                raise ValueError("--lora-modules needs --enable-lora.")
            engine_args = engine_args_from(args)
            adapters = {}
            for module in args.lora_modules or []:
                shutil.copytree(module["path"], staging / "adapters" / module["name"])
                adapters[module["name"]] = {"path": f"adapters/{module['name']}",
                                            "base_model_name": module["base_model_name"]}
            preload_model(engine_args, staging / "weights")
        meta = {"name": name, "created": time.time(), "model": str(args.model), "serve_args": serve_argv,
                "cwd": cwd, "adapters": adapters}
        (staging / META_FILE).write_text(json.dumps(meta, indent=1))
        os.rename(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def create_from_url(name: str, url: str, api_key: Optional[str] = None, more_serve_argv: Sequence[str] = ()) -> Path:
    """Snapshot the server running at ``url`` (``http://host:port``), asked with ``api_key``:
    ``create`` of the flags its ``/server_info`` reports, its adapters of now as
    ``--lora-modules``, ``--api-key api_key`` when it needs a key (it never reports its
    keys: the restored server takes the one used here), then ``more_serve_argv``.

    Raises:
        ValueError: no server answers, it refuses the key, it does not report its flags
            (not started by ``pagedllm serve``), or as ``create``.
    """
    from pagedllm.entrypoints.arg_parsing import drop_flag
    from pagedllm.entrypoints.openai.cli_args import serve_parser
    from pagedllm.entrypoints.openai.server_info import API_KEY_FLAG, LORA_MODULES_FLAG

    info = _server_info(url, api_key)
    if info.get("serve_args") is None:
        raise ValueError(f"The server at {url} does not report the flags it was started with; snapshot it with "
                         "`pagedllm snapshot create NAME [its serve flags]`.")
    argv = drop_flag(serve_parser(), info["serve_args"], LORA_MODULES_FLAG)
    if info["api_key"] and api_key:
        argv += [API_KEY_FLAG, api_key]
    if info["lora_modules"]:
        argv += [LORA_MODULES_FLAG, *(json.dumps(module) for module in info["lora_modules"])]
    return create(name, [*argv, *more_serve_argv], info["cwd"])


def _server_info(url: str, api_key: Optional[str]) -> dict[str, Any]:
    """``GET {url}/server_info``'s JSON.

    Raises:
        ValueError: no answer, 401 (the key), or another error status.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url.rstrip("/") + "/server_info", headers=headers, timeout=SERVER_INFO_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise ValueError(f"No pagedllm server answers at {url}: {exc}") from None
    if response.status_code == 401:
        raise ValueError(f"The server at {url} needs its API key: --api-key KEY.")
    if response.status_code != 200:
        raise ValueError(f"GET {url}/server_info answered {response.status_code}: {response.text[:200]}")
    return response.json()


def restore_command(name: str) -> tuple[list[str], dict[str, str], str]:
    """The ``pagedllm`` arguments, the environment and the folder that serve snapshot ``name``:
    ``serve <its flags> --load-format ipc_cache [--lora-modules <its copies>]`` in the folder
    its flags are relative to.

    Raises:
        ValueError: no snapshot of that name.
    """
    directory = snapshot_dir(name)
    if not (directory / META_FILE).exists():
        raise ValueError(f"No snapshot {name!r} in {snapshot_root()}; `pagedllm snapshot list` lists them.")
    meta = json.loads((directory / META_FILE).read_text())
    argv = ["serve", *meta["serve_args"], "--load-format", "ipc_cache"]
    if meta["adapters"]:
        argv += ["--lora-modules", *(_lora_module(n, directory, adapter) for n, adapter in meta["adapters"].items())]
    env = {**os.environ, "PAGEDLLM_PRELOAD_DIR": str(directory.absolute() / "weights")}
    return argv, env, meta.get("cwd", os.getcwd())


def _lora_module(name: str, directory: Path, adapter: Any) -> str:
    """The ``--lora-modules`` item of a snapshot's copy of an adapter (``adapter``: its
    ``snapshot.json`` entry; a bare folder in snapshots made before base models were kept)."""
    if isinstance(adapter, str):
        return f"{name}={directory.absolute() / adapter}"
    return json.dumps({"name": name, "path": str(directory.absolute() / adapter["path"]),
                       "base_model_name": adapter["base_model_name"]})


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
