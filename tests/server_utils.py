"""A real ``pagedllm serve`` process for tests.

``RemoteServer`` runs ``python -m pagedllm.entrypoints.cli serve [MODEL]`` on 127.0.0.1 and
a free port (engine in its own process, as in production), waits for ``/health`` and stops
it (SIGTERM, then SIGKILL; leftover engine processes too).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 180.0

# The shared server's settings (the ``server`` fixture, tests/conftest.py).
API_KEY = "sk-pagedllm-test"
#: A second key the shared server accepts (``--api-key`` takes several).
OTHER_API_KEY = "sk-pagedllm-other"
MODEL_NAME = "tiny-llama"
MODEL_ALIAS = "tiny-llama-alias"
MAX_MODEL_LEN = 2048


def is_multiprocessing_child(child: psutil.Process, server_command: list[str]) -> bool:
    """Whether ``child`` (a descendant of the server run as ``server_command``) is one of its
    engine or worker processes: a spawned one runs ``spawn_main``, a forked one keeps the
    server's command line (multiprocessing's resource tracker has neither)."""
    try:
        cmdline = child.cmdline()
    except psutil.Error:
        return False
    return "spawn_main" in " ".join(cmdline) or cmdline == [str(part) for part in server_command]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """``pagedllm serve`` in a subprocess (see the module docstring).

    Args:
        model: checkpoint directory (None: no MODEL argument, the shipped default model).
        flags: extra ``serve`` flags.
        api_key: passed as ``--api-key`` when set (the key ``headers`` and ``client`` use).
        other_api_keys: more keys given with it (vLLM's ``--api-key`` takes several).
        env: the server's environment instead of this process's.
        log_requests: log each request (by default the server runs with --disable-log-requests).
        command: the ``pagedllm`` subcommand that starts it (``("snapshot", "restore", NAME)``).
    """

    def __init__(
        self,
        model: Optional[Path],
        *flags: str,
        api_key: Optional[str] = None,
        other_api_keys: tuple[str, ...] = (),
        env: Optional[dict[str, str]] = None,
        log_requests: bool = False,
        command: tuple[str, ...] = ("serve",),
    ) -> None:
        self.port = _free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable, "-m", "pagedllm.entrypoints.cli", *command, *([str(model)] if model else []),
            "--port", str(self.port), "--dtype", "float32", "--kv-cache-memory-bytes", "16M",
            *([] if log_requests else ["--disable-log-requests"]),
            "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *flags,
        ]  # fmt: skip
        if api_key:
            argv += ["--api-key", api_key, *other_api_keys]
        env = dict(env if env is not None else os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        for name in ("PAGEDLLM_API_KEY", "VLLM_API_KEY"):
            env.pop(name, None)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-serve-", suffix=".log", delete=False)
        started = time.monotonic()
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._children: list[psutil.Process] = []
        try:
            self._wait_until_healthy()
        except BaseException:
            self.close()
            raise
        self.startup_s = time.monotonic() - started

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"pagedllm serve exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                if self.health_ok():
                    self._children = psutil.Process(self.process.pid).children(recursive=True)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"pagedllm serve did not become healthy in {STARTUP_TIMEOUT_S} s:\n{self.log_text()}")

    def health_ok(self) -> bool:
        """Whether ``/health`` answers 200 (a subclass may reach the server another way)."""
        return httpx.get(self.url + "/health", timeout=1.0).status_code == 200

    def log_text(self, last_chars: Optional[int] = 5000) -> str:
        """The server's log so far: its last ``last_chars`` characters (None: all of it)."""
        self.log.flush()
        text = Path(self.log.name).read_text()
        return text if last_chars is None else text[-last_chars:]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.get(self.url + path, headers=headers, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def engine_pids(self) -> list[int]:
        """Pids of the engine-core process(es) (spawned children of the server)."""
        return [pid for pid, parent in self._spawned() if parent == self.process.pid]

    def worker_pids(self) -> list[int]:
        """Pids of the engines' worker processes (``--tensor-parallel-size`` above 1), by pid."""
        engines = set(self.engine_pids())
        return sorted(pid for pid, parent in self._spawned() if parent in engines)

    def _spawned(self) -> list[tuple[int, int]]:
        """(pid, parent pid) of the server's descendants started by ``multiprocessing`` (fork
        or spawn: ``is_multiprocessing_child``)."""
        command = self.process.args
        return [
            (child.pid, child.ppid())
            for child in self._children
            if child.is_running() and is_multiprocessing_child(child, command)
        ]

    def metrics(self, by_engine: bool = False) -> dict[str, float]:
        """``/metrics`` as ``{"name{label=value,...}": value}``: the model_name label left out,
        and the engine label too (the series of all engines summed) unless ``by_engine``."""
        hidden = {"model_name"} if by_engine else {"model_name", "engine"}
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in hidden)
                key = f"{sample.name}{{{labels}}}" if labels else sample.name
                samples[key] = samples.get(key, 0.0) + sample.value
        return samples

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        for child in self._children:  # engine processes the server did not stop
            try:
                if child.is_running():
                    child.kill()
            except psutil.Error:
                pass
        self.log.close()
        os.unlink(self.log.name)


def idle_kv_cache_usage(server: RemoteServer, timeout_s: float = 5.0) -> float:
    """``pagedllm:kv_cache_usage_perc`` once ``server`` runs and waits for nothing (or after
    ``timeout_s`` seconds): 0.0 when every request gave its blocks back."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        busy = metrics.get("pagedllm:num_requests_running", 0) + metrics.get("pagedllm:num_requests_waiting", 0)
        if not busy or time.monotonic() > deadline:
            return metrics["pagedllm:kv_cache_usage_perc"]
        time.sleep(0.05)
