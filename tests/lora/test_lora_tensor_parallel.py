"""Multi-LoRA over tensor-parallel workers (``-tp 2``): the 4 adapters and base requests
mixed in one batch give the greedy outputs of ``-tp 1`` and of transformers on the
PEFT-merged models, with fewer slots than adapters (LRU reuse) and chunked prefill; over a
``-tp 2`` server, adapters load and unload at run time (every worker loads an adapter from
the request that first uses it: each rank gets the same ``execute_model`` call)."""

from __future__ import annotations

import os

import openai
import pytest

from tests.helpers import can_host_workers, float32_llm, hf_greedy, random_prompts
from tests.lora.test_lora_greedy_equality import check_mixed_batch
from tests.server_utils import RemoteServer

pytestmark = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")

#: Two slots for four adapters (requests wait and slots are reused) and 32-token steps.
ENGINE_KWARGS = dict(enable_lora=True, max_lora_rank=16, max_loras=2, max_cpu_loras=2, max_num_batched_tokens=32)
PROMPT = [17, 305, 42, 99, 512, 7, 640, 33]
MAX_TOKENS = 6


@pytest.mark.parametrize("tp", [1, 2])
def test_mixed_adapters_match_merged_transformers(tp, tiny_llama, peft_adapters, tokenizer):
    llm = float32_llm(tiny_llama, dict(ENGINE_KWARGS, tensor_parallel_size=tp))
    try:
        check_mixed_batch(llm, tiny_llama, peft_adapters, random_prompts([3, 17, 40], len(tokenizer), seed=7))
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_runtime_load_and_unload_over_tp2(tiny_llama, peft_adapters, tokenizer):
    adapter, merged = peft_adapters["all_r8"]
    env = dict(os.environ, PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    remote = RemoteServer(tiny_llama, "-tp", "2", "--enable-lora", "--max-lora-rank", "16", env=env)
    try:
        client = remote.client()

        def greedy_text(model: str) -> str:
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
            return reply.choices[0].text

        body = {"lora_name": "all", "lora_path": str(adapter)}
        assert remote.post("/v1/load_lora_adapter", json=body).status_code == 200
        assert greedy_text("all") == tokenizer.decode(hf_greedy(merged, PROMPT, MAX_TOKENS))
        assert greedy_text(str(tiny_llama)) == tokenizer.decode(hf_greedy(tiny_llama, PROMPT, MAX_TOKENS))
        assert remote.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="all", prompt="hi", max_tokens=2)
        assert remote.post("/v1/load_lora_adapter", json=body).status_code == 200  # again, same name
        assert greedy_text("all") == tokenizer.decode(hf_greedy(merged, PROMPT, MAX_TOKENS))
        assert len(remote.worker_pids()) == 2 and remote.health_ok()
    finally:
        remote.close()
