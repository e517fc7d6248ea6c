"""``pagedllm serve -dp 2``: two engine-core replicas behind one API server, on real
servers with the official ``openai`` client:

- many concurrent requests use both replicas (``/metrics`` per ``engine`` label) and give the
  same greedy outputs as one engine; each replica runs on its own CPU;
- one replica killed: every open request fails with an error naming it (no hang), and the
  server exits with code 1;

More replicas than CPUs: ``split_cpus``' error (tests/engine/test_dp_router.py), reported as
the one-line start-up error with exit code 2 that tests/entrypoints/openai/test_dp_tp_server.py
checks end to end for ``-dp M -tp N``.
"""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import psutil
import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.parallel_serving import MAX_TOKENS, check_every_replica_served, complete_all, settled_metrics
from tests.helpers import cpu_only
from tests.server_utils import RemoteServer

CPUS = sorted(os.sched_getaffinity(0))
# NOTE: CPU placement (one core share per replica); on CUDA each replica needs its own device.
pytestmark = [cpu_only, pytest.mark.skipif(len(CPUS) < 2, reason="two replicas need two CPUs")]


@pytest.fixture(scope="module")
def dp_server(tiny_llama):
    remote = RemoteServer(tiny_llama, "--served-model-name", MODEL_NAME, "--max-model-len", "2K", "-dp", "2")
    try:
        yield remote
    finally:
        remote.close()


def test_both_replicas_serve_and_match_one_engine(dp_server, server):
    affinities = sorted(psutil.Process(pid).cpu_affinity() for pid in dp_server.engine_pids())
    assert len(affinities) == 2 and not set(affinities[0]) & set(affinities[1])  # disjoint CPU shares
    assert sorted(affinities[0] + affinities[1]) == CPUS
    before = settled_metrics(dp_server)
    replies = asyncio.run(complete_all(dp_server.async_client(timeout=60)))
    expected = asyncio.run(complete_all(server.async_client(timeout=60)))
    assert replies == expected and all(tokens == MAX_TOKENS for _, tokens in replies)
    check_every_replica_served(before, settled_metrics(dp_server), 2)


async def _stream_until_failure(client: openai.AsyncOpenAI, started: asyncio.Event) -> BaseException:
    stream = await client.completions.create(
        model=MODEL_NAME, prompt="long", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    try:
        async for _ in stream:
            started.set()
    except openai.APIError as exc:
        return exc
    raise AssertionError("the stream ended without an error")


def test_a_killed_replica_fails_open_requests_and_the_server_exits_1(dp_server):
    """On the module's server, after the tests that need it alive (it ends that server)."""
    remote = dp_server
    pids = remote.engine_pids()
    replica_1 = max(pids, key=lambda pid: psutil.Process(pid).cpu_affinity()[0])  # the second share
    survivor = next(pid for pid in pids if pid != replica_1)

    async def scenario() -> list[BaseException]:
        client = remote.async_client(timeout=30)
        started = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(_stream_until_failure(client, event)) for event in started]
        for event in started:  # every stream is running (two on each replica)
            await asyncio.wait_for(event.wait(), 30)
        os.kill(replica_1, signal.SIGKILL)
        return list(await asyncio.wait_for(asyncio.gather(*streams), 30))

    errors = asyncio.run(scenario())
    code = remote.process.wait(timeout=30)
    log = remote.log_text()
    survivor_gone = not psutil.pid_exists(survivor) or psutil.Process(survivor).status() == psutil.STATUS_ZOMBIE
    assert code == 1
    dead = f"Data-parallel engine 1 (of 2) is dead: The engine core process (pid {replica_1}) exited with code -9"
    assert all(dead in str(error) for error in errors), errors
    assert dead in log and "stopping the API server (exit code 1)" in log
    assert survivor_gone
