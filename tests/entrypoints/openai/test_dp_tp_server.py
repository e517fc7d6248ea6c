"""``pagedllm serve -dp 2 -tp 2``: two engine-core replicas, each running a tensor-parallel
group of two worker processes with its own ``torch.distributed`` rendezvous (issue 17):

- concurrent requests use both replicas (``/metrics`` per ``engine`` label) and give the
  same greedy outputs as one process; each replica's workers sit on the cores its share of
  ``PAGEDLLM_CPU_OMP_THREADS_BIND`` names (4 processes on 2 cores here: explicit core lists
  may share cores, as for ``-tp`` alone); SIGTERM stops the server and every process, exit 0;
- a worker of one replica killed: the server exits 1 within seconds, naming it (no hang);
- more workers than cores under the automatic binding: a start-up error naming the numbers.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import psutil
import pytest

from pagedllm.platforms.cpu_binding import BIND_ENV
from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.parallel_serving import (
    MAX_TOKENS,
    check_every_replica_served,
    complete_all,
    kill_and_wait_for_exit,
    settled_metrics,
)
from tests.helpers import cpu_only
from tests.server_utils import RemoteServer, is_multiprocessing_child

CPUS = sorted(os.sched_getaffinity(0))
# NOTE: CPU binding by explicit core lists; on CUDA the replicas' workers need 4 devices.
pytestmark = [cpu_only, pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")]

#: Worker r of replica d on core CPUS[r]: each replica's two ranks on different cores.
CORE_LISTS = [[CPUS[0]], [CPUS[1]], [CPUS[0]], [CPUS[1]]]


def _dp2_tp2_server(tiny_llama) -> RemoteServer:
    env = dict(os.environ, **{BIND_ENV: "|".join(str(cores[0]) for cores in CORE_LISTS)})
    return RemoteServer(tiny_llama, "--served-model-name", MODEL_NAME, "--max-model-len", "2K", "-dp", "2", "-tp", "2",
                        env=env)


def _workers_by_replica(server: RemoteServer) -> list[list[int]]:
    """The worker pids of each replica, in rank order. Replicas and ranks start one after
    the other, so pid order is start order."""
    engines = sorted(server.engine_pids())
    return [sorted(child.pid for child in psutil.Process(pid).children()
                   if is_multiprocessing_child(child, server.process.args)) for pid in engines]


def test_both_replicas_serve_match_one_process_and_shut_down_cleanly(tiny_llama, server):
    remote = _dp2_tp2_server(tiny_llama)
    try:
        workers = _workers_by_replica(remote)
        assert [len(w) for w in workers] == [2, 2]
        # Replica d's rank r is machine-local rank 2d + r: core list 2d + r.
        assert [psutil.Process(pid).cpu_affinity() for w in workers for pid in w] == CORE_LISTS
        before = settled_metrics(remote)
        replies = asyncio.run(complete_all(remote.async_client(timeout=120)))
        expected = asyncio.run(complete_all(server.async_client(timeout=60)))
        assert replies == expected and all(tokens == MAX_TOKENS for _, tokens in replies)
        check_every_replica_served(before, settled_metrics(remote), 2)
        processes = [psutil.Process(pid) for pid in remote.engine_pids() + [p for w in workers for p in w]]
        remote.process.terminate()
        code = remote.process.wait(timeout=60)
        _, alive = psutil.wait_procs(processes, timeout=20)
        log = remote.log_text()
    finally:
        remote.close()
    assert code == 0, log
    assert not alive, f"left running after shutdown: {alive}"


def test_a_killed_worker_of_one_replica_stops_the_server_with_exit_1(tiny_llama):
    remote = _dp2_tp2_server(tiny_llama)
    try:
        victim = _workers_by_replica(remote)[1][1]
        code, took, log = kill_and_wait_for_exit(remote, victim)
    finally:
        remote.close()
    assert code == 1, log
    assert took < 20, f"the server took {took:.1f} s to exit after a worker died"
    assert "died (killed by SIGKILL)" in log and f"(pid {victim})" in log, log
    assert "Data-parallel engine 1 (of 2) is dead" in log, log


def test_more_workers_than_cores_is_a_start_up_error(tiny_llama):
    size = len(CPUS)
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llama), "--port", "0",
         "-dp", str(size), "-tp", "2"],
        capture_output=True, text=True, timeout=180,
        env={k: v for k, v in dict(os.environ, OMP_NUM_THREADS="1").items() if k != BIND_ENV},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    message = (f"data_parallel_size {size} x tensor_parallel_size x pipeline_parallel_size 2 = {2 * size} worker "
               f"processes need at least one CPU core each, but this process may use {size} core(s)")
    assert message in result.stderr.strip().splitlines()[-1]
