"""``pagedllm bench startup``: how long until the engine can serve.

Measurements (``--mode``), each start in a fresh process (nothing warm but the OS page cache):

- ``serve``: ``pagedllm serve MODEL ...`` from process start until ``GET /health``
  answers 200 (polled every 20 ms), then the server is stopped with SIGINT.
- ``llm``: a fresh ``python`` that runs ``from pagedllm import LLM; LLM(model=...)``;
  the time from interpreter start to the constructor's return (``llm_process_s``) and
  the constructor alone, imports included (``llm_construction_s``).
- ``preload``: as ``serve``, with ``--load-format ipc_cache``, while one ``pagedllm preload``
  daemon (started first, in a private ``PAGEDLLM_PRELOAD_DIR``, not timed) holds the weights.
- ``snapshot``: ``pagedllm snapshot restore`` of a snapshot of the same server (``pagedllm
  snapshot create`` first, in a private ``PAGEDLLM_SNAPSHOT_DIR``, not timed), as ``serve``.
- ``snapshot-daemon``: as ``snapshot`` while a ``pagedllm preload`` daemon of the same flags
  runs, which forks the restored servers (``pagedllm.preload.fork_server``; so does the
  daemon of ``preload``).
- ``wake``: one server with ``--enable-sleep-mode``; each iteration puts it to sleep
  (``POST /sleep?level=1``, then ``level=2``) and times ``POST /wake_up`` until it answers.

After each server start and each wake-up one completion request (``max_tokens`` 1) is
timed: the first request's time to first token (``*_first_token_s``).

Each is repeated ``--num-iters`` times after ``--num-iters-warmup`` unrecorded runs (the
first run on a machine also builds the C++ CPU kernels and fills the page cache).
Reported: the list of times and their median, in seconds (also in ``--output-json``); for the
server starts also the CPU seconds its processes (the server and its engine) had used by then,
``*_cpu_s`` (Linux' ``/proc``; the figure that counts on a busy host, where the wall time is
mostly waiting for a core); a server forked by a preload daemon counts as the growth of the
daemon's process tree.
"""

from __future__ import annotations

import argparse
import contextlib
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
from typing import Any, Iterator, NamedTuple, Optional

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
    parser.add_argument("--mode", default="serve,llm",
                        help="comma-separated: serve, llm, preload, snapshot, snapshot-daemon, wake (default: serve,llm)")
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


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Start(NamedTuple):
    """One server start: seconds until ``/health`` was 200 (wall clock), the CPU seconds its
    process tree had used then (None where ``/proc`` is missing), and the seconds of the first
    request sent right after (``first_token_s``)."""

    seconds: float
    cpu_s: Optional[float]
    first_token_s: float


def first_token_s(url: str) -> float:
    """Seconds of one completion request (a 6-word prompt, ``max_tokens`` 1, greedy, not
    streamed: its time to first token) to the server at ``url``, the model's name asked
    first (``GET /v1/models``, not timed).

    Raises:
        RuntimeError: the server answered an error.
    """
    with urllib.request.urlopen(url + "/v1/models", timeout=_START_TIMEOUT_S) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "The first request after a start", "max_tokens": 1,
                       "temperature": 0.0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=_START_TIMEOUT_S) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"the first request failed: {exc.code} {exc.read()[:500]!r}") from exc
    return time.perf_counter() - start


def tree_cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of process ``pid`` and its live descendants (``/proc``), or
    None without ``/proc``."""
    if not os.path.isdir("/proc/self"):
        return None
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            parents[int(entry)] = int(fields[1])
            used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += used.get(current, 0.0)
        todo += [child for child, parent in parents.items() if parent == current]
    return total


def _start_server(args: argparse.Namespace, extra: list[str], env: Optional[dict[str, str]] = None,
                  restore: Optional[str] = None, daemon_pid: Optional[int] = None
                  ) -> tuple[subprocess.Popen, str, Start]:
    """A ``pagedllm serve`` process (``pagedllm snapshot restore RESTORE``, which keeps its own
    flags, with ``restore``), its URL, and its ``Start`` (the CPU of the preload daemon
    ``daemon_pid``'s tree added, as it grew meanwhile: the servers it forks).

    Raises:
        RuntimeError: the server exited or did not become healthy within 300 s.
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
    if restore is None:
        cmd += ["serve", "--port", str(port), *engine_flags(args), *shlex.split(args.serve_args)]
    else:
        cmd += ["snapshot", "restore", restore, "--port", str(port)]
    cmd += extra
    daemon_before = tree_cpu_seconds(daemon_pid) if daemon_pid else None
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    while not _healthy(url + "/health"):
        if proc.poll() is not None:
            raise RuntimeError(f"pagedllm serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        if time.perf_counter() - start > _START_TIMEOUT_S:
            _stop(proc)
            raise RuntimeError(f"pagedllm serve was not healthy after {_START_TIMEOUT_S:.0f} s")
        time.sleep(0.02)
    seconds = time.perf_counter() - start
    cpu_s = tree_cpu_seconds(proc.pid)
    if cpu_s is not None and daemon_before is not None:
        cpu_s += (tree_cpu_seconds(daemon_pid) or 0.0) - daemon_before
    return proc, url, Start(seconds, cpu_s, first_token_s(url))


def time_serve(args: argparse.Namespace, extra: tuple[str, ...] = (), env: Optional[dict[str, str]] = None,
               daemon_pid: Optional[int] = None) -> Start:
    """A start of ``pagedllm serve`` (with ``extra`` flags, in ``env``; ``daemon_pid``: see
    ``_start_server``) until ``/health`` is 200.

    Raises:
        RuntimeError: the server exited or did not become healthy within 300 s.
    """
    proc, _, started = _start_server(args, list(extra), env, daemon_pid=daemon_pid)
    _stop(proc)
    return started


def _post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=_START_TIMEOUT_S).close()


def time_wake(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per iteration (``--num-iters``, after the warm-up ones): seconds of ``POST /wake_up``
    after ``POST /sleep?level=1`` and after ``level=2``, and of the first request after each
    (``first_token_s``), on one ``--enable-sleep-mode`` server."""
    proc, url, _ = _start_server(args, ["--enable-sleep-mode"])
    times: dict[str, list[float]] = {"wake_level1_s": [], "wake_level2_s": [], "wake_level1_first_token_s": [],
                                     "wake_level2_first_token_s": []}
    try:
        for i in range(args.num_iters_warmup + args.num_iters):
            for level in (1, 2):
                _post(f"{url}/sleep?level={level}")
                start = time.perf_counter()
                _post(f"{url}/wake_up")
                woken = time.perf_counter() - start
                first = first_token_s(url)
                if i >= args.num_iters_warmup:
                    times[f"wake_level{level}_s"].append(woken)
                    times[f"wake_level{level}_first_token_s"].append(first)
    finally:
        _stop(proc)
    return times


@contextlib.contextmanager
def preload_daemon(args: argparse.Namespace, prefix: str) -> Iterator[tuple[subprocess.Popen, str, dict]]:
    """A ``pagedllm preload`` daemon of ``args``' engine flags in a temporary folder under
    /dev/shm (named ``prefix``...), ready (its control socket up); yields the process, the
    folder and the environment a server needs to map it. Stopped on exit.

    Raises:
        RuntimeError: the daemon exited or was not ready within 300 s.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix=prefix, dir="/dev/shm") as root:
        env = {**os.environ, "PAGEDLLM_PRELOAD_DIR": root}
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "preload", *engine_flags(args)]
        daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        try:
            start = time.perf_counter()
            while not os.path.exists(os.path.join(root, "control.sock")):
                if daemon.poll() is not None or time.perf_counter() - start > _START_TIMEOUT_S:
                    raise RuntimeError(f"pagedllm preload did not start: {daemon.stderr.read()[-2000:]}")
                time.sleep(0.05)
            yield daemon, root, env
        finally:
            _stop(daemon)


def time_preload(args: argparse.Namespace) -> list[Start]:
    """Starts of ``pagedllm serve --load-format ipc_cache`` (seconds to ``/health`` 200) while a
    ``pagedllm preload`` daemon (``preload_daemon``) holds the weights.

    Raises:
        RuntimeError: the daemon exited or was not ready within 300 s; a server failed.
    """
    with preload_daemon(args, "pagedllm-bench-preload-") as (daemon, _root, env):
        for _ in range(args.num_iters_warmup):
            time_serve(args, ("--load-format", "ipc_cache"), env, daemon.pid)
        return [time_serve(args, ("--load-format", "ipc_cache"), env, daemon.pid) for _ in range(args.num_iters)]


def time_snapshot(args: argparse.Namespace, with_daemon: bool = False) -> list[Start]:
    """Starts of ``pagedllm snapshot restore`` (seconds to ``/health`` 200) of one snapshot of
    the benchmarked server (``pagedllm snapshot create``, not timed) in a temporary
    ``PAGEDLLM_SNAPSHOT_DIR``; ``with_daemon``: while a ``preload_daemon`` runs (it forks them).

    Raises:
        RuntimeError: the snapshot could not be made; a server failed.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-snapshot-") as root:
        env = {**os.environ, "PAGEDLLM_SNAPSHOT_DIR": root}
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "snapshot", "create", "bench", *engine_flags(args),
               *shlex.split(args.serve_args)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=_START_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"pagedllm snapshot create failed: {done.stderr[-2000:]}")

        with contextlib.ExitStack() as stack:
            daemon_pid = None
            if with_daemon:
                daemon, _root, env = stack.enter_context(preload_daemon(args, "pagedllm-bench-restore-"))
                env["PAGEDLLM_SNAPSHOT_DIR"] = root
                daemon_pid = daemon.pid

            def one() -> Start:
                proc, _, started = _start_server(args, [], env, restore="bench", daemon_pid=daemon_pid)
                _stop(proc)
                return started

            for _ in range(args.num_iters_warmup):
                one()
            return [one() for _ in range(args.num_iters)]


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


def _record(result: dict[str, Any], key: str, starts: list[Start], what: str) -> None:
    times = [s.seconds for s in starts]
    result.update({key: times, f"median_{key}": _median(times)})
    line = f"{what} until /health 200: median {_median(times):.2f} s  ({', '.join(f'{t:.2f}' for t in times)})"
    if all(s.cpu_s is not None for s in starts):
        cpu = [s.cpu_s for s in starts]
        cpu_key = key[: -len("_s")] + "_cpu_s"
        result.update({cpu_key: cpu, f"median_{cpu_key}": _median(cpu)})
        line += f"; CPU median {_median(cpu):.2f} s"
    first = [s.first_token_s for s in starts]
    first_key = key[: -len("_s")] + "_first_token_s"
    result.update({first_key: first, f"median_{first_key}": _median(first)})
    line += f"; then the first request's first token: median {_median(first):.3f} s"
    print(line)


def main(args: argparse.Namespace) -> int:
    modes = {m.strip() for m in args.mode.split(",") if m.strip()}
    unknown = modes - {"serve", "llm", "preload", "snapshot", "snapshot-daemon", "wake"}
    if unknown:
        raise SystemExit(f"pagedllm bench startup: error: unknown --mode {sorted(unknown)}; use serve, llm, preload, "
                         "snapshot, snapshot-daemon, wake")
    result: dict[str, Any] = {"machine": machine_info(), "model": args.model, "dtype": args.dtype}
    if "serve" in modes:
        for _ in range(args.num_iters_warmup):
            time_serve(args)
        _record(result, "serve_startup_s", [time_serve(args) for _ in range(args.num_iters)], "pagedllm serve")
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
    if "preload" in modes:
        _record(result, "preload_serve_startup_s", time_preload(args), "pagedllm serve --load-format ipc_cache")
    if "snapshot" in modes:
        _record(result, "snapshot_serve_startup_s", time_snapshot(args), "pagedllm snapshot restore")
    if "snapshot-daemon" in modes:
        _record(result, "snapshot_daemon_serve_startup_s", time_snapshot(args, with_daemon=True),
                "pagedllm snapshot restore forked by a preload daemon")
    if "wake" in modes:
        wakes = time_wake(args)
        for name, times in wakes.items():
            result.update({name: times, f"median_{name}": _median(times)})
        print(f"POST /wake_up after /sleep?level=1: median {_median(wakes['wake_level1_s']):.2f} s "
              f"(first token {_median(wakes['wake_level1_first_token_s']):.3f} s); "
              f"after level=2: median {_median(wakes['wake_level2_s']):.2f} s "
              f"(first token {_median(wakes['wake_level2_first_token_s']):.3f} s)")
    write_json(args.output_json, result)
    return 0
