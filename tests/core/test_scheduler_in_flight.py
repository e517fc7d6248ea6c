"""The scheduler with several steps in flight (micro-batches, ``pagedllm.engine.batch_queue``):
a request in a step whose output is not back is neither scheduled again nor preempted; a
step may be capped in requests; with pipeline parallelism each step carries its tokens."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages.runner_output import ModelRunnerOutput
from pagedllm.executor.abstract import PP_MAX_CONCURRENT_BATCHES_ENV, pipeline_max_concurrent_batches
from tests.core.test_scheduler import add, fake_run, make_scheduler


def test_requests_in_flight_are_not_scheduled_again_until_their_output_is_back():
    s = make_scheduler()
    for r in "abc":
        add(s, r, 5)
    first = s.schedule(max_num_reqs=2)
    assert first.num_scheduled_tokens == {"a": 5, "b": 5}
    second = s.schedule()
    assert second.num_scheduled_tokens == {"c": 5}
    assert s.in_flight == {"a", "b", "c"}
    assert not s.has_schedulable_requests() and s.schedule().is_empty
    fake_run(s, first)
    assert s.in_flight == {"c"} and s.has_schedulable_requests()
    assert s.schedule().num_scheduled_tokens == {"a": 1, "b": 1}  # their decodes; c still in flight


def test_the_next_prompt_chunk_waits_for_the_previous_one():
    s = make_scheduler(max_num_batched_tokens=10)
    add(s, "long", 25)
    first = s.schedule()
    assert first.num_scheduled_tokens == {"long": 10}
    assert s.schedule().is_empty
    fake_run(s, first)
    assert s.schedule().num_scheduled_tokens == {"long": 10}


def test_preemption_skips_requests_in_flight():
    # 6 blocks of 4 tokens; three 7-token prompts take 2 blocks each.
    s = make_scheduler(num_blocks=6, block_size=4)
    for r in "abc":
        add(s, r, 7, max_tokens=6)
    fake_run(s, s.schedule())
    ab = s.schedule(max_num_reqs=2)  # token 8 of a and b: fits in their second block
    c = s.schedule()  # token 8 of c, in flight from now
    assert list(ab.num_scheduled_tokens) == ["a", "b"] and list(c.num_scheduled_tokens) == ["c"]
    fake_run(s, ab)
    out = s.schedule()  # token 9 of a needs a third block: b is preempted, not c (newer, in flight)
    assert s.num_preemptions == 1
    assert s.waiting[0].request_id == "b" and s.waiting[0].status == RequestStatus.PREEMPTED
    assert s.requests["c"].status == RequestStatus.RUNNING and "c" in s.in_flight
    assert out.num_scheduled_tokens == {"a": 1} and "b" in out.finished_req_ids
    fake_run(s, c)
    fake_run(s, out)
    while s.has_unfinished_requests():
        fake_run(s, s.schedule())
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 6


def test_an_abort_in_flight_frees_now_and_its_output_is_dropped():
    s = make_scheduler()
    add(s, "a", 5)
    add(s, "b", 5)
    out = s.schedule()
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert "a" not in s.requests and "a" in s.finished_req_ids
    runner_output = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[7], [7]])
    outputs = s.update_from_output(out, runner_output)
    assert [o.request_id for o in outputs.outputs] == ["b"]
    assert not s.in_flight


def test_with_pipeline_parallelism_each_step_carries_the_tokens_it_computes():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=128)
    s = Scheduler(config, KVCacheManager(64, 4, enable_caching=False), use_pp=True)
    add(s, "a", 6)
    fake_run(s, s.schedule())  # the first chunk goes as a new request (all its tokens)
    out = s.schedule()
    assert out.scheduled_cached_reqs.new_token_ids == [[5, 6]]
    fake_run(s, out, token=42)
    assert s.schedule().scheduled_cached_reqs.new_token_ids == [[42]]
    plain = make_scheduler(max_num_batched_tokens=4)
    add(plain, "a", 6)
    fake_run(plain, plain.schedule())
    assert plain.schedule().scheduled_cached_reqs.new_token_ids == []


@pytest.mark.parametrize("value, expected", [(None, 2), ("1", 1), ("2", 2), ("8", 2)])
def test_max_concurrent_batches_is_one_per_stage_unless_the_variable_says(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(PP_MAX_CONCURRENT_BATCHES_ENV, raising=False)
    else:
        monkeypatch.setenv(PP_MAX_CONCURRENT_BATCHES_ENV, value)
    assert pipeline_max_concurrent_batches(2) == expected
    assert pipeline_max_concurrent_batches(1) == 1


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_max_concurrent_batches_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(PP_MAX_CONCURRENT_BATCHES_ENV, value)
    with pytest.raises(ValueError, match="PAGEDLLM_PP_MAX_CONCURRENT_BATCHES=.* must be a positive integer"):
        pipeline_max_concurrent_batches(2)
