"""``AsyncLLM`` over ``DPAsyncMPClient`` (two engine-core processes): aborts reach the replica
that serves the request, every replica ends idle with all its blocks free, statistics count
per engine; replicas need processes of their own."""

from __future__ import annotations

import asyncio
import os
import time

import psutil
import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.dp_client import DPAsyncMPClient
from tests.helpers import cpu_only

two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two CPUs")


def metric(llm: AsyncLLM, name: str, **labels) -> float:
    value = llm.metrics_registry.get_sample_value(name, {"model_name": llm.served_model_name, **labels})
    return 0.0 if value is None else value


async def wait_idle(llm: AsyncLLM, timeout_s: float = 5.0) -> list[dict]:
    """Every replica's block accounting once nothing runs there (``block_accounting`` checks
    the block pool's integrity too)."""
    deadline = time.monotonic() + timeout_s
    while True:
        accounting = await llm.engine_core.call_utility_async("block_accounting")
        if all(a["num_unfinished_requests"] == 0 and a["num_free_blocks"] == a["num_blocks"] for a in accounting):
            return accounting
        assert time.monotonic() < deadline, accounting
        await asyncio.sleep(0.02)


@cpu_only
@two_cpus
def test_aborts_reach_the_serving_replica_and_both_end_idle(tiny_llama):
    args = EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory_bytes=8 << 20,
                      data_parallel_size=2, usage_context="api_server")  # fmt: skip
    llm = AsyncLLM.from_engine_args(args)
    try:
        client = llm.engine_core
        assert isinstance(client, DPAsyncMPClient) and len(set(client.engine_pids)) == 2

        async def scenario() -> dict[str, int]:
            long = SamplingParams(max_tokens=1000, ignore_eos=True)
            short = SamplingParams(max_tokens=4, ignore_eos=True)
            streams = {f"long{i}": llm.generate([7, 8, 9 + i], long, f"long{i}") for i in range(4)}
            for stream in streams.values():
                await stream.__anext__()  # running
            replicas = {rid: client.router.replica_of(rid) for rid in streams}
            assert sorted(replicas.values()) == [0, 0, 1, 1]
            await llm.abort(list(streams))

            async def run_short(i: int) -> int:
                async for output in llm.generate([3, 4, 5 + i], short, f"short{i}"):
                    last = output
                assert last.finished
                return len(last.outputs[0].token_ids)

            assert await asyncio.gather(*(run_short(i) for i in range(4))) == [4] * 4
            await wait_idle(llm)  # an abort sent to the wrong replica would leave a request running
            assert client.router.loads == [0, 0]
            return replicas

        replicas = asyncio.run(scenario())
        for engine in "01":  # two aborts and two short requests per replica, counted there
            labels = {"engine": engine}
            assert metric(llm, "pagedllm:request_success_total", finished_reason="abort", **labels) == 2
            assert metric(llm, "pagedllm:request_success_total", finished_reason="length", **labels) == 2
        assert set(replicas.values()) == {0, 1}
    finally:
        llm.shutdown()
    assert llm.errored and not any(psutil.pid_exists(pid) for pid in client.engine_pids)


def test_replicas_need_their_own_processes(tiny_llama):
    args = EngineArgs(model=str(tiny_llama), data_parallel_size=2, usage_context="api_server")
    with pytest.raises(ValueError, match=r"Data-parallel engine replicas run in processes of their own \(multiprocess=True\)"):
        AsyncLLM.from_engine_args(args, multiprocess=False)
