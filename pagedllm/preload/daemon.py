"""``pagedllm preload``: the daemon that owns the stores of preloaded weights, and its control
socket.

``preload_model(engine_args)`` loads the model as the workers of that configuration would (every
load-time transformation included; with tensor / pipeline parallelism, the same worker
processes, each loading its own shard) and writes one store per rank under
``PAGEDLLM_PRELOAD_DIR`` (``pagedllm.preload.store``). ``serve_control`` then answers on ``<dir>/control.sock`` until
asked to stop; on stop (or SIGTERM / SIGINT) it deletes every store and the socket. A daemon
killed outright leaves its stores: engines that map one keep serving from it, and new ones
may still map it. A second ``pagedllm preload`` while a daemon runs writes its store beside
the others (the daemon lists and evicts every store of the folder) and exits.

The control protocol: one JSON object per connection each way, ``{"op": "status" | "list" |
"evict" | "stop", "model": path (evict; None: every store)}``; and ``"fork"``: fork a server
(``pagedllm.preload.fork_server``), when ``serve_control`` is given ``run_server``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from pagedllm.config import EngineArgs
from pagedllm.preload import fork_server
from pagedllm.preload.ipc_cache import preload_root
from pagedllm.preload.key import cache_key, store_name
from pagedllm.preload.store import KEY_FILE, read_key, write_store

logger = logging.getLogger(__name__)

SOCKET_NAME = fork_server.SOCKET_NAME
#: Seconds a control client waits for the daemon.
CONTROL_TIMEOUT_S = 10.0


def preload_model(engine_args: EngineArgs, root: Optional[Path] = None) -> list[Path]:
    """Load the model of ``engine_args`` as its workers would and write one store per rank
    in ``root`` (None: ``PAGEDLLM_PRELOAD_DIR``); returns the stores' folders in rank order.

    With tensor or pipeline parallelism the workers of that configuration are started once
    (the multiprocess executor: their own process group, so each loads its own shard) and
    each writes its rank's store (``key.store_name``), then they exit.

    Raises:
        ValueError: a bad argument or a model that cannot be stored.
    """
    config = engine_args.create_engine_config()
    config = dataclasses.replace(config, model_config=dataclasses.replace(config.model_config, load_format="safetensors"))
    root = root or preload_root()
    if config.parallel_config.world_size == 1:
        from pagedllm.worker.worker import Worker

        worker = Worker(config)
        worker.init_device()
        worker.load_model()
        try:
            return [Path(write_rank_store(worker, str(root)))]
        finally:
            worker.shutdown()
            del worker
            # NOTE: the loaded model sits in reference cycles; without a collection the daemon
            # keeps a private copy of the weights beside the store (0.5B shape: 1.0 GB RSS).
            gc.collect()
    from pagedllm.executor.multiproc_executor import MultiprocExecutor

    executor = MultiprocExecutor(config)
    try:
        return [Path(p) for p in executor.collective_rpc(write_rank_store, args=(str(root),))]
    finally:
        executor.shutdown()


def write_rank_store(worker: Any, root: str) -> str:
    """Write the loaded model of ``worker`` (a ``Worker``, in its rank's process group) as its
    rank's store in ``root``; returns the store's folder (a ``collective_rpc`` callable)."""
    model_config = worker.config.model_config
    key = cache_key(model_config)
    directory = Path(root) / store_name(model_config.model_path, key["tensor_parallel_rank"],
                                        key["pipeline_parallel_rank"])
    nbytes = write_store(worker.model_runner.model, directory, key)
    logger.info("Preloaded %s (tensor-parallel rank %d/%d, pipeline rank %d/%d): %.1f MB in %s", key["model_path"],
                key["tensor_parallel_rank"], key["tensor_parallel_size"], key["pipeline_parallel_rank"],
                key["pipeline_parallel_size"], nbytes / 1e6, directory)
    return str(directory)


def stores(root: Path) -> list[dict[str, Any]]:
    """Every store in ``root``: its folder name, size and key fields."""
    found = []
    for directory in sorted(p for p in root.iterdir() if (p / KEY_FILE).exists()) if root.exists() else []:
        meta = read_key(directory)
        found.append({"name": directory.name, "nbytes": meta["nbytes"], **meta["key"]})
    return found


def evict(root: Path, model: Optional[str]) -> list[str]:
    """Delete the stores of ``model`` (a path; None: all); returns their names. Engines that
    map one keep its pages until they exit."""
    wanted = None if model is None else str(Path(model).resolve())
    names = [s["name"] for s in stores(root) if wanted is None or s["model_path"] == wanted]
    for name in names:
        shutil.rmtree(root / name, ignore_errors=True)
    return names


def serve_control(root: Path, run_server: Optional[Callable[[list[str]], int]] = None) -> None:
    """Answer control requests on ``root/control.sock`` until "stop" (or SIGTERM / SIGINT),
    then delete every store and the socket. With ``run_server`` (``pagedllm <argv>``'s
    function, returning its exit code) it also forks servers (``fork_server``); servers it
    forked serve on after it stopped."""
    path = root / SOCKET_NAME
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if path.exists():
        path.unlink()
    with fork_server.unix_address(path) as address:
        server.bind(address)
    server.listen(8)
    started = time.time()
    stopping = False

    def on_signal(signum: int, _: Any) -> None:
        nonlocal stopping
        stopping = True
        server.close()

    in_main_thread = threading.current_thread() is threading.main_thread()  # signals reach that one only
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)} if in_main_thread else {}
    try:
        while not stopping:
            try:
                connection, _ = server.accept()
            except OSError:
                break
            with connection:
                request, fds = fork_server.receive(connection)
                if request.get("op") == fork_server.OP and run_server is not None:
                    fork_server.fork(connection, request, fds, server, run_server)
                    continue
                for fd in fds:
                    os.close(fd)
                reply, stopping = _answer(root, request, started)
                connection.sendall((json.dumps(reply) + "\n").encode())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
        path.unlink(missing_ok=True)
        evicted = evict(root, None)
        logger.info("Preload daemon stopped; deleted %d store(s).", len(evicted))


def _answer(root: Path, request: dict[str, Any], started: float) -> tuple[dict[str, Any], bool]:
    """The reply to one control request, and whether the daemon stops after it."""
    op = request.get("op")
    if op == "status":
        held = stores(root)
        return {"pid": os.getpid(), "root": str(root), "uptime_s": time.time() - started, "stores": len(held),
                "nbytes": sum(s["nbytes"] for s in held)}, False
    if op == "list":
        return {"stores": stores(root)}, False
    if op == "evict":
        return {"evicted": evict(root, request.get("model"))}, False
    if op == "stop":
        return {"stopped": True, "pid": os.getpid()}, True
    return {"error": f"unknown op {op!r}; the ops are status, list, evict, stop"}, False


def control(root: Path, op: str, **fields: Any) -> Optional[dict[str, Any]]:
    """Send one request to the daemon of ``root``; its reply, or None when none answers."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(CONTROL_TIMEOUT_S)
    try:
        with fork_server.unix_address(root / SOCKET_NAME) as address:
            client.connect(address)
        client.sendall((json.dumps({"op": op, **fields}) + "\n").encode())
        return json.loads(client.makefile().readline())
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    finally:
        client.close()
