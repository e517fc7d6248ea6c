"""Tensor parallelism through ``LLM(tensor_parallel_size=2)`` (the multiprocess executor, two
worker processes joined by gloo, all-reduce through shared memory): greedy output
token-identical to one process under chunked prefill, preemption and prefix caching;
logprobs close; seeded sampling identical; KV heads replicated when ranks outnumber them;
the KV cache sized per rank; a worker's start-up error re-raised as it was; and a killed
worker making the next step fail at once, not hang.

Starting workers takes a while, so each engine starts once per module.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.multiproc_executor import MultiprocExecutor, WorkerDeadError
from tests.helpers import can_host_workers, check_block_accounting, random_prompts

pytestmark = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")

MAX_TOKENS = 10
#: Chunked prefill (64-token steps), preemption (32 blocks of 8 tokens for ~60 needed) and
#: prefix caching (on by default; the prompts share prefixes and run twice).
ENGINE_KWARGS = dict(
    dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=64, num_gpu_blocks_override=32
)


def _prompts() -> list[list[int]]:
    prompts = random_prompts([1, 7, 17, 40, 90, 150], 1000, seed=11)
    shared = prompts[4][:48]
    return prompts + [shared + [5, 6, 7], shared + [8, 9]]


def _greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)


@pytest.fixture(scope="module")
def tp1(tiny_llama):
    return LLM(str(tiny_llama), **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def tp2(tiny_llama):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_greedy_tp2_equals_tp1_with_chunks_preemption_and_prefix_hits(tp1, tp2):
    prompts = _prompts()
    expected = [o.outputs[0].token_ids for o in _greedy(tp1, prompts)]
    core = tp2.llm_engine.engine_core
    assert isinstance(core.model_executor, MultiprocExecutor)
    cached_tokens = []
    for _ in range(2):  # the second round hits the prefix cache
        outputs = _greedy(tp2, prompts)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        cached_tokens.append(sum(o.num_cached_tokens for o in outputs))
    assert core.scheduler.num_preemptions > 0
    assert cached_tokens[1] > 0
    check_block_accounting(tp2)


def test_logprobs_close_to_tp1(tp1, tp2):
    prompts = random_prompts([5, 40], 1000, seed=12)
    for ref, got in zip(_greedy(tp1, prompts, logprobs=5, prompt_logprobs=3), _greedy(tp2, prompts, logprobs=5, prompt_logprobs=3)):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for ref_entry, got_entry in zip(ref.outputs[0].logprobs, got.outputs[0].logprobs):
            assert ref_entry.keys() == got_entry.keys()
            for token, logprob in ref_entry.items():
                assert abs(got_entry[token].logprob - logprob.logprob) < 1e-4
        for ref_entry, got_entry in zip(ref.prompt_logprobs[1:], got.prompt_logprobs[1:]):
            for token, logprob in ref_entry.items():
                assert abs(got_entry[token].logprob - logprob.logprob) < 1e-4


def test_seeded_sampling_equals_tp1(tp1, tp2):
    """Every rank samples (the same tokens) and keeps its own batch: seeded requests give
    the tokens one process gives."""
    prompts = random_prompts([6, 25], 1000, seed=14)
    outputs = {}
    for name, llm in (("tp1", tp1), ("tp2", tp2)):
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
                  for i in range(len(prompts))]
        result = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[name] = [o.outputs[0].token_ids for o in result]
    assert outputs["tp2"] == outputs["tp1"]


def test_a_worker_start_up_error_keeps_its_type_and_message(tiny_llama):
    with pytest.raises(ValueError, match="The KV cache cannot hold one sequence of max_model_len = 256") as info:
        LLM(str(tiny_llama), tensor_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1024)
    assert str(info.value.__cause__).startswith("in worker rank ")  # whichever answered first


def test_each_rank_holds_half_the_kv_heads(tp2):
    """tiny_llama has 2 KV heads: one per rank, so a block costs half as much per rank."""
    shapes = tp2.llm_engine.engine_core.model_executor.collective_rpc(_kv_cache_shape)
    assert shapes == [shapes[0]] * 2
    assert shapes[0][-2] == 1  # [2, num_blocks, block_size, num_kv_heads, head_dim]


def _kv_cache_shape(worker) -> tuple:
    return tuple(worker.model_runner.kv_caches[0].shape)


def test_kv_heads_replicated_when_ranks_outnumber_them(checkpoint_factory):
    """One KV head and two ranks: each rank holds the head (vLLM's replication)."""
    path = checkpoint_factory("LlamaForCausalLM", seed=7, num_key_value_heads=1)
    prompts = random_prompts([3, 30, 70], 1000, seed=13)
    expected = [o.outputs[0].token_ids for o in _greedy(LLM(str(path), **ENGINE_KWARGS), prompts)]
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE_KWARGS)
    try:
        assert [o.outputs[0].token_ids for o in _greedy(llm, prompts)] == expected
        shapes = llm.llm_engine.engine_core.model_executor.collective_rpc(_kv_cache_shape)
        assert [s[-2] for s in shapes] == [1, 1]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_killed_worker_fails_the_next_step_at_once(tp2):
    """Last in the module: it kills a worker of the shared engine."""
    executor = tp2.llm_engine.engine_core.model_executor
    rank1 = executor.worker_pids[1]
    os.kill(rank1, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerDeadError, match=rf"Worker rank 1 \(pid {rank1}\) died \(killed by SIGKILL\)"):
        _greedy(tp2, [[5, 6, 7]])
    assert time.monotonic() - started < 30
    with pytest.raises(WorkerDeadError, match="The workers stopped earlier"):
        executor.check_health()
