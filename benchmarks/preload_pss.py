"""Memory of two servers of one model: mapped from one ``pagedllm preload`` store against
loaded normally, per process (RSS and PSS from ``/proc/PID/smaps_rollup``, Linux only).

    PAGEDLLM_DISABLE_CPU_KERNELS=1 python benchmarks/preload_pss.py \\
        --model benchmarks/checkpoints/qwen2-0.5b-shape --dtype bfloat16 --max-model-len 2048 \\
        --kv-cache-memory-bytes 256M

Phase ``preload``: a ``pagedllm preload`` daemon (its own ``PAGEDLLM_PRELOAD_DIR`` under
``/dev/shm``) and two ``pagedllm serve ... --load-format ipc_cache`` servers; phase
``normal``: two ``pagedllm serve`` servers loading the checkpoint. Once every server of a
phase answers ``/health`` and one greedy completion each, every process of the phase (the
daemon; each server's front end, its engine process and the engine's workers) is measured. PSS
divides each shared page among the processes that map it, so the weights of one store count
once over both servers; the store's own size (the tmpfs bytes, in memory even while nobody
maps them) is printed beside it. Servers of one phase run side by side, the phases one after
the other. Engine flags are passed to every process alike (``pagedllm bench startup``'s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from typing import Any, Optional

from pagedllm.benchmarks import machine_info
from pagedllm.benchmarks.startup import _START_TIMEOUT_S, _start_server, _stop, preload_daemon
from pagedllm.config.engine_args import add_engine_args

#: The ``smaps_rollup`` fields reported, in kB there, MB here.
FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def smaps_rollup(pid: int) -> dict[str, float]:
    """``FIELDS`` of process ``pid`` in MB (1e6 bytes)."""
    values = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in FIELDS:
                values[name] = int(rest.split()[0]) * 1024 / 1e6
    return values


def descendants(pid: int) -> list[tuple[int, int]]:
    """``(pid, depth)`` of ``pid`` (depth 0) and its live descendants, parents first (``/proc/*/stat``)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, todo = [], [(pid, 0)]
    while todo:
        current, depth = todo.pop(0)
        found.append((current, depth))
        todo += [(child, depth + 1) for child in sorted(c for c, parent in parents.items() if parent == current)]
    return found


#: What a process of a server's tree is, by its depth (the daemon's tree is one process).
_KINDS = ("front end", "engine", "worker")


def _complete(url: str, model: str) -> None:
    """One greedy completion (so that each server has run its model once)."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=_START_TIMEOUT_S).close()


def _measure(phase: str, roles: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """One row per process of each ``(role, pid)`` tree."""
    rows = []
    for role, root in roles:
        for pid, depth in descendants(root):
            kind = "daemon" if role == "daemon" else _KINDS[min(depth, len(_KINDS) - 1)]
            try:
                rows.append({"phase": phase, "role": role, "pid": pid, "process": kind, **smaps_rollup(pid)})
            except OSError:  # exited meanwhile
                continue
    return rows


def _served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def _servers(args: argparse.Namespace, extra: list[str], env: Optional[dict[str, str]]) -> list[tuple[Any, str]]:
    servers = []
    try:
        for _ in range(2):
            proc, url, _started = _start_server(args, extra, env)
            servers.append((proc, url))
            _complete(url, _served_model(url))
    except BaseException:
        for proc, _ in servers:
            _stop(proc)
        raise
    return servers


def run_preload(args: argparse.Namespace) -> tuple[list[dict[str, Any]], int]:
    """The daemon and two ``ipc_cache`` servers: their rows, and the store's bytes."""
    with preload_daemon(args, "pagedllm-preload-pss-") as (daemon, root, env):
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
        servers = _servers(args, ["--load-format", "ipc_cache"], env)
        try:
            roles = [("daemon", daemon.pid)] + [(f"server {i}", p.pid) for i, (p, _) in enumerate(servers)]
            return _measure("preload", roles), nbytes
        finally:
            for proc, _ in servers:
                _stop(proc)


def run_normal(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Two servers that load the checkpoint: their rows."""
    servers = _servers(args, [], None)
    try:
        return _measure("normal", [(f"server {i}", p.pid) for i, (p, _) in enumerate(servers)])
    finally:
        for proc, _ in servers:
            _stop(proc)


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"{'phase':8} {'role':9} {'pid':>7} {'process':16} " + " ".join(f"{f + ' MB':>12}" for f in FIELDS))
    for row in rows:
        print(f"{row['phase']:8} {row['role']:9} {row['pid']:>7} {row['process']:16} "
              + " ".join(f"{row.get(f, 0.0):>12.1f}" for f in FIELDS))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(parser, unset=True)
    parser.set_defaults(dtype="auto")
    parser.add_argument("--serve-args", default="", help="extra `pagedllm serve` flags, one string")
    parser.add_argument("--output-json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows, nbytes = run_preload(args)
    rows += run_normal(args)
    _print(rows)
    totals = {phase: {f: sum(r.get(f, 0.0) for r in rows if r["phase"] == phase) for f in FIELDS}
              for phase in ("preload", "normal")}
    for phase, total in totals.items():
        print(f"{phase}: all processes: RSS {total['Rss']:.1f} MB, PSS {total['Pss']:.1f} MB")
    print(f"preload store (tmpfs): {nbytes / 1e6:.1f} MB")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"machine": machine_info(), "model": args.model, "rows": rows, "totals": totals,
                       "store_bytes": nbytes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
