"""Prefill / decode split vs one server on a mixed long-prompt load: TPOT p99 (and TTFT).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/disagg_tpot.py --num-prompts 32 --input-len 512 \\
        --range-ratio 0.9 --output-len 64 --request-rate 2

Runs the same ``pagedllm bench serve`` load (random prompts of ``input-len`` x [1 - ratio,
1 + ratio] tokens, Poisson arrivals, streamed completions) against one ``pagedllm serve``
for each ``--one-server-threads`` count (default: ``--threads``), then against ``pagedllm
router`` over a ``--role prefill`` and a ``--role decode`` instance with ``--threads / 2``
threads each (the same cores in all). On a loaded machine a process's threads wait for
each other at every barrier, so one server may do better with fewer threads: give both. Prefix caching is off on both sides, so neither reuses a prompt. Each server
logs to ``--log-dir``. Prints each run's TTFT / TPOT / ITL mean and p99 and the ratio of
the TPOT p99s; ``--output-json`` writes both results.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A command in its own session, healthy once ``GET /health`` answers 200; killed on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, threads: Optional[int], log_dir: Path) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        self.log = log_dir / f"{name}.log"
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Process":
        print(f"$ {' '.join(self.cmd)}  (log: {self.log})", flush=True)
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"{self.name} not healthy in 600 s; see {self.log}")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _serve(model: Optional[str], port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *([model] if model else []),
            "--port", str(port), "--no-enable-prefix-caching", "--disable-log-requests", *extra]


def _bench(args: argparse.Namespace, port: int, label: str) -> dict[str, Any]:
    from pagedllm.benchmarks import serve as bench_serve

    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    bench_args = parser.parse_args([
        "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--random-range-ratio", str(args.range_ratio),
        "--output-len", str(args.output_len), "--request-rate", str(args.request_rate), "--ignore-eos",
        "--prompt-format", "token-ids", "--disable-tqdm", "--label", label, "--seed", str(args.seed),
        *(["--model", args.model] if args.model else []),
    ])  # fmt: skip
    return bench_serve.run(bench_args)


def _row(result: dict[str, Any]) -> str:
    return " ".join(f"{m} mean {result[f'mean_{m}_ms']:8.1f} p99 {result[f'p99_{m}_ms']:8.1f} ms |"
                    for m in ("ttft", "tpot", "itl")) + f" {result['completed']} done"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the model that ships with pagedllm")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--range-ratio", type=float, default=0.9)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=2, help="threads in all (split: half per instance)")
    parser.add_argument("--one-server-threads", type=int, nargs="+", default=None,
                        help="thread counts of the one-server runs (default: --threads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="/tmp/disagg_tpot")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    half = max(args.threads // 2, 1)

    port = _free_port()
    results = {}
    for threads in args.one_server_threads or [args.threads]:
        with Process(f"one-server-{threads}", _serve(args.model, port), port, threads, log_dir):
            results[f"one_server_{threads}_threads"] = _bench(args, port, f"one server, {threads} threads")
    prefill_port, decode_port, router_port, kv_port = (_free_port() for _ in range(4))
    kv_config = json.dumps({"kv_connector": "TCPConnector", "kv_port": kv_port})
    with Process("prefill", _serve(args.model, prefill_port, "--role", "prefill", "--kv-transfer-config", kv_config),
                 prefill_port, half, log_dir), \
            Process("decode", _serve(args.model, decode_port, "--role", "decode"), decode_port, half, log_dir), \
            Process("router", [sys.executable, "-m", "pagedllm.entrypoints.cli", "router", "--port", str(router_port),
                               "--prefill", f"http://127.0.0.1:{prefill_port}",
                               "--decode", f"http://127.0.0.1:{decode_port}"], router_port, None, log_dir):
        split = results["split"] = _bench(args, router_port, "prefill + decode")
    for name, result in results.items():
        print(f"{name:24} {_row(result)}")
    for name, result in results.items():
        if name != "split":
            print(f"TPOT p99: split / {name} = {split['p99_tpot_ms'] / result['p99_tpot_ms']:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
