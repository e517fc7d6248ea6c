"""``pagedllm bench startup``: how long until the engine can serve.

Two measurements, each in fresh processes (nothing warm but the OS page cache):

- ``serve``: ``pagedllm serve MODEL ...`` from process start until ``GET /health``
  answers 200 (polled every 20 ms), then the server is stopped with SIGINT.
- ``llm``: a fresh ``python`` that runs ``from pagedllm import LLM; LLM(model=...)``;
  the time from interpreter start to the constructor's return (``llm_process_s``) and
  the constructor alone, imports included (``llm_construction_s``).

Each is repeated ``--num-iters`` times after ``--num-iters-warmup`` unrecorded runs (the
first run on a machine also builds the C++ CPU kernels and fills the page cache).
Reported: the list of times and their median, in seconds (also in ``--output-json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Optional

import numpy as np

from pagedllm.benchmarks import machine_info, write_json
from pagedllm.config.engine_args import add_engine_args, given_engine_kwargs
from pagedllm.entrypoints.arg_parsing import flag_as_args

#: Seconds one start may take before it counts as failed.
_START_TIMEOUT_S = 300.0


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``pagedllm serve``'s engine flags (``add_engine_args``), given to both the server and
    ``LLM`` (unset ones keep their defaults; ``--dtype`` defaults to auto), and this
    benchmark's own."""
    add_engine_args(parser, unset=True)
    parser.set_defaults(dtype="auto")
    parser.add_argument("--serve-args", default="", help="extra `pagedllm serve` flags, one string")
    parser.add_argument("--mode", default="serve,llm", help="comma-separated: serve, llm (default: both)")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="unrecorded starts first (default: 1)")
    parser.add_argument("--num-iters", type=int, default=3, help="recorded starts of each mode (default: 3)")
    parser.add_argument("--output-json", default=None, help="write the results here")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The command-line form of the engine flags given in ``args`` (``--dtype`` always)."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    actions = {action.dest: action for action in parser._actions}
    return [arg for name, value in given_engine_kwargs(args).items()
            for arg in flag_as_args(actions[name].option_strings[0], actions[name], value)]


def time_serve(args: argparse.Namespace) -> float:
    """Seconds from starting ``pagedllm serve`` until ``/health`` is 200.

    Raises:
        RuntimeError: the server exited or did not become healthy within 300 s.
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), *engine_flags(args)]
    cmd += shlex.split(args.serve_args)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None:
                raise RuntimeError(f"pagedllm serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            if time.perf_counter() - start > _START_TIMEOUT_S:
                raise RuntimeError(f"pagedllm serve was not healthy after {_START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        return time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_LLM_SCRIPT = """
import json, sys, time
start = time.perf_counter()
from pagedllm import LLM
kwargs = json.loads(sys.argv[1])
LLM(**kwargs)
print(json.dumps({"llm_construction_s": time.perf_counter() - start}))
"""


def time_llm(args: argparse.Namespace) -> dict[str, float]:
    """``llm_process_s`` (interpreter start to ``LLM(...)`` returned) and
    ``llm_construction_s`` (import + constructor), seconds.

    Raises:
        RuntimeError: the child process failed.
    """
    kwargs = given_engine_kwargs(args)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _LLM_SCRIPT, json.dumps(kwargs)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=_START_TIMEOUT_S)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"LLM construction failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["llm_process_s"] = elapsed
    return result


def _median(values: list[float]) -> Optional[float]:
    return float(np.median(values)) if values else None


def main(args: argparse.Namespace) -> int:
    modes = {m.strip() for m in args.mode.split(",") if m.strip()}
    unknown = modes - {"serve", "llm"}
    if unknown:
        raise SystemExit(f"pagedllm bench startup: error: unknown --mode {sorted(unknown)}; use serve, llm")
    result: dict[str, Any] = {"machine": machine_info(), "model": args.model, "dtype": args.dtype}
    if "serve" in modes:
        for _ in range(args.num_iters_warmup):
            time_serve(args)
        times = [time_serve(args) for _ in range(args.num_iters)]
        result.update(serve_startup_s=times, median_serve_startup_s=_median(times))
        print(f"pagedllm serve until /health 200: median {_median(times):.2f} s  ({', '.join(f'{t:.2f}' for t in times)})")
    if "llm" in modes:
        for _ in range(args.num_iters_warmup):
            time_llm(args)
        runs = [time_llm(args) for _ in range(args.num_iters)]
        process = [r["llm_process_s"] for r in runs]
        construction = [r["llm_construction_s"] for r in runs]
        result.update(llm_process_s=process, median_llm_process_s=_median(process),
                      llm_construction_s=construction, median_llm_construction_s=_median(construction))
        print(f"LLM(...) in a fresh process: median {_median(process):.2f} s "
              f"(import + constructor {_median(construction):.2f} s)")
    write_json(args.output_json, result)
    return 0
