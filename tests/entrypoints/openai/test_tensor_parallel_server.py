"""``pagedllm serve -tp 2``: the OpenAI client gets the same greedy completions as one
process; a worker killed while the server is idle stops the server with exit status 1
(within seconds: the engine checks its workers about once a second while idle)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.openai.parallel_serving import kill_and_wait_for_exit
from tests.helpers import can_host_workers, random_prompts
from tests.server_utils import RemoteServer

pytestmark = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")

MAX_TOKENS = 8


def test_tp2_server_matches_one_process_and_exits_1_when_a_worker_dies(tiny_llama):
    prompts = random_prompts([4, 30, 75], 1000, seed=21)
    reference = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = reference.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = [o.outputs[0].text for o in outputs]
    server = RemoteServer(tiny_llama, "-tp", "2", "--max-model-len", "512")
    try:
        client = server.client()
        for prompt, text in zip(prompts, expected):
            completion = client.completions.create(
                model=str(tiny_llama), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            assert completion.choices[0].text == text
            assert completion.usage.completion_tokens == MAX_TOKENS
        workers = server.worker_pids()
        assert len(workers) == 2
        code, took, log = kill_and_wait_for_exit(server, workers[1])
    finally:
        server.close()
    assert code == 1, log
    assert took < 20, f"the server took {took:.1f} s to exit after a worker died"
    assert f"Worker rank 1 (pid {workers[1]}) died (killed by SIGKILL)" in log, log
