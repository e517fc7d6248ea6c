"""The preload daemon as a fork server (``pagedllm.preload.fork_server``): a ``serve --load-format
ipc_cache`` and a ``snapshot restore`` started while a daemon runs are forked by it and give
transformers' greedy tokens; a forked server keeps serving when the daemon is killed, stops
when its client is killed, and still refuses a store whose key differs (naming the field); a
client whose environment differs from the daemon's is not forked but started as before."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pagedllm.preload import fork_server
from pagedllm.snapshot import snapshots
from tests.helpers import hf_greedy
from tests.server_utils import RemoteServer, idle_kv_cache_usage

PROMPT = [1, 5, 9, 200, 31, 77, 3]
MAX_TOKENS = 8
FLAGS = ("--dtype", "float32", "--max-model-len", "64")


def _env(root: Path) -> dict[str, str]:
    # RemoteServer's own settings: the daemon forks only servers of its environment
    return dict(os.environ, PAGEDLLM_PRELOAD_DIR=str(root), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


class _Daemon:
    """A ``pagedllm preload MODEL`` process in ``root``, ready (its control socket up)."""

    def __init__(self, model: Path, root: Path) -> None:
        self.root = root
        self.log = root.parent / f"{root.name}.log"
        argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "preload", str(model), *FLAGS]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log.open("w"), env=_env(root))
        deadline = time.monotonic() + 180
        while not (root / fork_server.SOCKET_NAME).exists():
            assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)


@pytest.fixture
def daemon(tiny_llama, tmp_path):
    # deeper than an AF_UNIX address holds (108 bytes): the socket is bound and reached
    # through the folder's descriptor (fork_server.unix_address)
    root = tmp_path / "preload" / ("deep-" * 20)
    root.mkdir(parents=True)
    assert len(str(root / fork_server.SOCKET_NAME)) > 108
    running = _Daemon(tiny_llama, root)
    yield running
    running.close()


def test_unix_address_of_a_short_and_a_deep_path(tmp_path):
    short = Path("/tmp") / "c.sock"
    with fork_server.unix_address(short) as address:
        assert address == str(short)
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    with fork_server.unix_address(deep / "c.sock") as address:
        assert address.startswith("/proc/self/fd/") and len(address) < 108
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(address)
    assert (deep / "c.sock").exists()
    with pytest.raises(FileNotFoundError):
        with fork_server.unix_address(tmp_path / ("e" * 120) / "c.sock"):
            pass


def _greedy(server: RemoteServer) -> list[int]:
    reply = server.client().completions.create(model=server.client().models.list().data[0].id, prompt=PROMPT,
                                               max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1,
                                               extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(token.removeprefix("token_id:")) for token in reply.choices[0].logprobs.tokens]


def _forked_pid(daemon: _Daemon) -> int:
    (child,) = daemon.children()
    return child.pid


def test_forked_server_serves_and_outlives_the_daemon(tiny_llama, daemon):
    expected = hf_greedy(tiny_llama, PROMPT, MAX_TOKENS)
    server = RemoteServer(tiny_llama, *FLAGS, "--load-format", "ipc_cache", env=_env(daemon.root))
    try:
        forked = _forked_pid(daemon)
        assert psutil.Process(forked).children()  # its engine core process
        assert "Mapped the preloaded weights" in server.log_text()
        assert _greedy(server) == expected
        daemon.process.kill()  # outright: the store stays, the server keeps its mapping and session
        daemon.process.wait(10)
        assert _greedy(server) == expected and _greedy(server) == expected
        assert idle_kv_cache_usage(server) == 0.0
    finally:
        server.close()
    assert server.process.returncode == 0
    psutil.wait_procs([psutil.Process(forked)] if psutil.pid_exists(forked) else [], timeout=30)
    assert not psutil.pid_exists(forked) or psutil.Process(forked).status() == psutil.STATUS_ZOMBIE


def test_forked_server_stops_with_its_client(tiny_llama, daemon):
    server = RemoteServer(tiny_llama, *FLAGS, "--load-format", "ipc_cache", env=_env(daemon.root))
    try:
        forked = psutil.Process(_forked_pid(daemon))
        server.process.kill()  # the client dies without forwarding a signal
        gone, alive = psutil.wait_procs([forked, *forked.children(recursive=True)], timeout=60)
        assert not alive
        with pytest.raises(httpx.ConnectError):  # nothing holds the port
            server.get("/health")
    finally:
        server.close()


def test_restore_is_forked_by_the_daemon(tiny_llama, daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_SNAPSHOT_DIR", str(tmp_path / "snapshots"))
    snapshots.create("tiny", [str(tiny_llama), *FLAGS])
    env = dict(_env(daemon.root), PAGEDLLM_SNAPSHOT_DIR=str(tmp_path / "snapshots"))
    restored = RemoteServer(None, command=("snapshot", "restore", "tiny"), env=env)
    try:
        assert psutil.Process(_forked_pid(daemon)).children()  # the forked server's engine core
        assert "snapshots/tiny/weights/" in restored.log_text()  # it mapped the snapshot's store, not the daemon's
        assert _greedy(restored) == hf_greedy(tiny_llama, PROMPT, MAX_TOKENS)
        assert idle_kv_cache_usage(restored) == 0.0
    finally:
        restored.close()


def test_forked_server_refuses_a_store_of_another_key(tiny_llama, daemon):
    argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llama), "--load-format", "ipc_cache",
            "--dtype", "bfloat16", "--max-model-len", "64", "--port", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(daemon.root), timeout=180)
    assert done.returncode == 2
    assert "do not match this engine: dtype (preloaded: 'float32', this engine: 'bfloat16')" in done.stderr
    assert "Forked a server" in daemon.log.read_text()  # the forked server checked the key


def test_a_client_of_another_environment_is_not_forked(tiny_llama, daemon):
    request = {"executable": sys.executable, "sys_path": sys.path[1:], "package": fork_server._package_dir(),
               "env": dict(os.environ)}
    assert fork_server.refusal(request) is None
    assert fork_server.refusal({**request, "env": dict(os.environ, PAGEDLLM_PRELOAD_DIR="/elsewhere")}) is None
    assert "OMP_WAIT_POLICY differs" in fork_server.refusal({**request, "env": dict(os.environ, OMP_WAIT_POLICY="x")})
    assert "interpreter" in fork_server.refusal({**request, "executable": "/usr/bin/python0"})
    # entries the daemon's own imports appended (setuptools' _vendor) do not matter; others do
    assert fork_server.refusal({**request, "sys_path": sys.path[1:-1]}) is None
    assert "sys.path differs" in fork_server.refusal({**request, "sys_path": ["/elsewhere", *sys.path[1:]]})
    env = dict(_env(daemon.root), OMP_WAIT_POLICY="passive")
    server = RemoteServer(tiny_llama, *FLAGS, "--load-format", "ipc_cache", env=env)
    try:
        assert "OMP_WAIT_POLICY differs" in server.log_text()  # started here, mapping the store itself
        assert daemon.children() == []
        assert _greedy(server) == hf_greedy(tiny_llama, PROMPT, MAX_TOKENS)
    finally:
        server.close()
