"""What the parallel serving tests share (``-dp``, ``-tp`` and both): a batch of greedy
completions sent at once, the settled per-engine ``/metrics``, the check that every replica
served part of a batch, and killing one engine or worker process of a server."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.server_utils import RemoteServer

#: Prompts of 3 to 40 tokens: some share no full block, some share their first block.
PROMPTS = [list(range(10 + i, 13 + 2 * i)) for i in range(12)] + [list(range(50, 66)) + [i] for i in range(4)]
MAX_TOKENS = 8


async def complete_all(client: openai.AsyncOpenAI, model: str = MODEL_NAME) -> list[tuple[str, int]]:
    """Every prompt of ``PROMPTS`` at once, greedy: (text, completion tokens) each."""

    async def one(prompt: list[int]) -> tuple[str, int]:
        reply = await client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
        )
        return reply.choices[0].text, reply.usage.completion_tokens

    return list(await asyncio.gather(*(one(prompt) for prompt in PROMPTS)))


def settled_metrics(server: RemoteServer) -> dict[str, float]:
    """``/metrics`` by engine once no request runs or waits (at most 5 s)."""
    deadline = time.monotonic() + 5.0
    while True:
        metrics = server.metrics(by_engine=True)
        busy = sum(v for k, v in metrics.items() if k.startswith(("pagedllm:num_requests_running{", "pagedllm:num_requests_waiting{")))
        if not busy or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def check_every_replica_served(before: dict[str, float], after: dict[str, float], num_replicas: int) -> None:
    """Between the two ``settled_metrics``, ``PROMPTS`` ran once each, every replica (``engine``
    label) finished some of them, the token counts add up and every KV cache is empty again."""
    engines = [str(e) for e in range(num_replicas)]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    finished = [delta(f"pagedllm:request_success_total{{engine={e},finished_reason=length}}") for e in engines]
    generated = [delta(f"pagedllm:generation_tokens_total{{engine={e}}}") for e in engines]
    assert min(finished) > 0 and sum(finished) == len(PROMPTS), finished
    assert generated == [n * MAX_TOKENS for n in finished]
    assert sum(delta(f"pagedllm:prompt_tokens_total{{engine={e}}}") for e in engines) == sum(map(len, PROMPTS))
    assert all(after[f"pagedllm:kv_cache_usage_perc{{engine={e}}}"] == 0.0 for e in engines)


def kill_and_wait_for_exit(server: RemoteServer, pid: int, timeout_s: float = 60.0) -> tuple[int, float, str]:
    """SIGKILL ``pid`` (an engine or worker process of ``server``), wait for the server to
    exit: (its exit code, seconds it took, its log)."""
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    code = server.process.wait(timeout=timeout_s)
    return code, time.monotonic() - killed, server.log_text()
