"""Pipeline parallelism through ``LLM(pipeline_parallel_size=2)`` (the multiprocess executor,
one worker process per stage, hidden states passed on by gloo send / recv, two micro-batches
in flight): greedy output token-identical to one process under chunked prefill, preemption
and prefix caching; logprobs close; seeded sampling (n > 1 too) identical; two steps really
in flight, stage 0 running one while stage 1 runs the one before; aborts of requests in
flight; each stage holding only its layers, its KV cache and its end of the model; tensor
x pipeline parallelism (2 x 2) identical too; and the start-up errors of too many stages.

Starting workers takes a while, so each engine starts once per module.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.utils import pp_layer_partition
from pagedllm.executor.multiproc_executor import MultiprocExecutor
from pagedllm.platforms import current_platform
from pagedllm.platforms.cpu_binding import BIND_ENV
from tests.helpers import can_host_workers, check_block_accounting, random_prompts

MAX_TOKENS = 10
#: Chunked prefill (64-token steps), preemption (32 blocks of 8 tokens for ~60 needed) and
#: prefix caching (on by default; the prompts share prefixes and run twice).
ENGINE_KWARGS = dict(
    dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=64, num_gpu_blocks_override=32
)
needs_two_workers = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")


def _prompts() -> list[list[int]]:
    prompts = random_prompts([1, 7, 17, 40, 90, 150], 1000, seed=21)
    shared = prompts[4][:48]
    return prompts + [shared + [5, 6, 7], shared + [8, 9]]


def _greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)


def _tokens(outputs) -> list:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def pp1(tiny_llama):
    return LLM(str(tiny_llama), **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def pp2(tiny_llama):
    llm = LLM(str(tiny_llama), pipeline_parallel_size=2, **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@needs_two_workers
def test_greedy_pp2_equals_pp1_with_chunks_preemption_and_prefix_hits(pp1, pp2):
    prompts = _prompts()
    expected = _tokens(_greedy(pp1, prompts))
    core = pp2.llm_engine.engine_core
    assert isinstance(core.model_executor, MultiprocExecutor)
    cached_tokens = []
    for _ in range(2):  # the second round hits the prefix cache
        outputs = _greedy(pp2, prompts)
        assert _tokens(outputs) == expected
        cached_tokens.append(sum(o.num_cached_tokens for o in outputs))
    assert core.scheduler.num_preemptions > 0
    assert cached_tokens[1] > 0
    assert core.batch_queue.max_batches_in_flight == 2
    check_block_accounting(pp2)


def _step_times(worker) -> list:
    return list(worker.step_times)


def _num_overlapping_steps(step_times: list[list[tuple[float, float]]]) -> int:
    """Steps n that stage 1 was still running when stage 0 started step n + 1."""
    stage0, stage1 = step_times
    return sum(stage0[n + 1][0] < stage1[n][1] for n in range(min(len(stage0) - 1, len(stage1))))


@needs_two_workers
def test_two_micro_batches_are_in_flight_and_the_stages_overlap(pp1, pp2):
    prompts = random_prompts([3, 5, 9, 12, 4, 7, 10, 6], 1000, seed=25)
    expected = _tokens(_greedy(pp1, prompts))
    core = pp2.llm_engine.engine_core
    executor = core.model_executor
    assert executor.max_concurrent_batches == 2
    executor.collective_rpc("get_comm_stats", kwargs={"reset": True})
    core.batch_queue.max_batches_in_flight = 0
    assert _tokens(_greedy(pp2, prompts)) == expected
    assert core.batch_queue.max_batches_in_flight == 2
    step_times = executor.collective_rpc(_step_times)
    assert len(step_times[0]) == len(step_times[1]) >= MAX_TOKENS
    assert _num_overlapping_steps(step_times) >= MAX_TOKENS // 2
    check_block_accounting(pp2)


@needs_two_workers
def test_n_above_one_with_seeds_equals_pp1(pp1, pp2):
    prompts = random_prompts([4, 30, 11], 1000, seed=26)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = {}
    for name, llm in (("pp1", pp1), ("pp2", pp2)):
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[name] = [[c.token_ids for c in r.outputs] for r in results]
    assert outputs["pp2"] == outputs["pp1"]
    assert all(len(completions) == 3 for completions in outputs["pp2"])


@needs_two_workers
def test_aborts_of_requests_in_flight(pp1, pp2):
    """Requests aborted while their step is in flight free their blocks at once; requests
    added next (sharing the aborted prompts' prefixes) get those blocks while the step still
    runs, and every request left gives the single-process tokens."""
    engine = pp2.llm_engine
    scheduler = engine.engine_core.scheduler
    prompts = random_prompts([20, 30, 25, 35], 1000, seed=27)
    late = [prompts[0][:16] + [1, 2, 3], prompts[1][:24] + [4]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [f"abort-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    engine.step()
    aborted = [rid for rid in ids if rid in scheduler.in_flight]
    assert aborted and engine.engine_core.batch_queue.batches
    engine.abort_request(aborted)
    for i, prompt in enumerate(late):
        engine.add_request(f"late-{i}", {"prompt_token_ids": prompt}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    kept = [rid for rid in ids if rid not in aborted]
    assert set(finished) == {*kept, "late-0", "late-1"}
    expected = _tokens(_greedy(pp1, [prompts[ids.index(rid)] for rid in kept] + late))
    assert [finished[rid] for rid in [*kept, "late-0", "late-1"]] == expected
    engine.step()  # the last step in flight, if any, comes back
    check_block_accounting(pp2)


@needs_two_workers
def test_logprobs_and_seeded_sampling_equal_pp1(pp1, pp2):
    prompts = random_prompts([5, 40], 1000, seed=22)
    for ref, got in zip(_greedy(pp1, prompts, logprobs=5, prompt_logprobs=3),
                        _greedy(pp2, prompts, logprobs=5, prompt_logprobs=3)):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for ref_entry, got_entry in zip(ref.outputs[0].logprobs + ref.prompt_logprobs[1:],
                                        got.outputs[0].logprobs + got.prompt_logprobs[1:]):
            assert ref_entry.keys() == got_entry.keys()
            for token, logprob in ref_entry.items():
                assert abs(got_entry[token].logprob - logprob.logprob) < 1e-4
    outputs = {}
    for name, llm in (("pp1", pp1), ("pp2", pp2)):
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=200 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
                  for i in range(len(prompts))]
        outputs[name] = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert outputs["pp2"] == outputs["pp1"]


def _stage_contents(worker) -> dict:
    model = worker.model_runner.model
    names = {name.split(".weight")[0] for name, _ in model.named_parameters()}
    return {
        "layers": sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}),
        "embed": "model.embed_tokens" in names,
        "head": "lm_head" in names and "model.norm" in names,
        "kv_caches": len(worker.model_runner.kv_caches),
    }


@needs_two_workers
def test_each_stage_holds_its_layers_kv_cache_and_end_of_the_model(pp2):
    """tiny_llama has 2 layers: layer 0, the embedding and its KV cache on stage 0; layer 1,
    the final norm, the LM head and its KV cache on stage 1."""
    contents = pp2.llm_engine.engine_core.model_executor.collective_rpc(_stage_contents)
    assert contents == [
        {"layers": [0], "embed": True, "head": False, "kv_caches": 1},
        {"layers": [1], "embed": False, "head": True, "kv_caches": 1},
    ]


def test_tp2_pp2_equals_pp1(tiny_llama, pp1, monkeypatch):
    """Four ranks (TP groups [0, 1], [2, 3]; PP groups [0, 2], [1, 3]). On a CPU with fewer
    than 4 cores the workers share the cores unpinned (``nobind``)."""
    if current_platform.is_cpu and not can_host_workers(4):
        monkeypatch.setenv(BIND_ENV, "nobind")
    elif not can_host_workers(4):
        pytest.skip("needs 4 GPUs")
    prompts = random_prompts([3, 30, 70], 1000, seed=23)
    expected = _tokens(_greedy(pp1, prompts))
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE_KWARGS)
    try:
        assert _tokens(_greedy(llm, prompts)) == expected
        contents = llm.llm_engine.engine_core.model_executor.collective_rpc(_stage_contents)
        assert [c["layers"] for c in contents] == [[0], [0], [1], [1]]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_more_stages_than_layers_is_refused_at_start_up(tiny_llama):
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's num_hidden_layers 2"):
        LLM(str(tiny_llama), pipeline_parallel_size=3, **ENGINE_KWARGS)


@pytest.mark.parametrize("num_layers, pp, partition, expected", [
    (4, 2, None, [2, 2]),
    (5, 2, None, [3, 2]),
    (10, 4, None, [2, 3, 3, 2]),  # the extra layers go to the stages before the last, as vLLM
    (5, 2, "1,4", [1, 4]),
])
def test_layer_partition(num_layers, pp, partition, expected):
    assert pp_layer_partition(num_layers, pp, partition) == expected


@pytest.mark.parametrize("partition", ["1,1", "3,2,0", "a,b", "0,5"])
def test_a_bad_layer_partition_names_the_variable(partition):
    with pytest.raises(ValueError, match="PAGEDLLM_PP_LAYER_PARTITION=.* must be 2 positive layer counts"):
        pp_layer_partition(5, 2, partition)
