"""The priority scheduling policy (vLLM's ``--scheduling-policy priority``) and the RUNNING
admission cap (``max_num_active_seqs``), with a fake model runner (plain Python)."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import RequestStatus
from pagedllm.core.request_queue import PriorityRequestQueue
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import fake_run


def make(policy="priority", num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, active=None):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=128, policy=policy, max_num_active_seqs=active)
    return Scheduler(config, KVCacheManager(num_blocks, 4, enable_caching=False))


def add(s, req_id, num_prompt, priority=0, arrival=0.0, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    s.add_request(EngineCoreRequest(req_id, list(range(1, num_prompt + 1)), params, 0, arrival, priority=priority))


def test_waiting_queue_runs_lower_priority_first_ties_by_arrival():
    s = make(max_num_seqs=1)
    add(s, "late_low", 3, priority=1, arrival=0.0)
    add(s, "b", 3, priority=0, arrival=2.0)
    add(s, "a", 3, priority=0, arrival=1.0)
    assert [r.request_id for r in s.waiting] == ["a", "b", "late_low"]
    order = []
    while s.has_unfinished_requests():
        out = s.schedule()
        order += [r.req_id for r in out.scheduled_new_reqs]
        fake_run(s, out)
    assert order == ["a", "b", "late_low"]
    # FCFS keeps arrival order whatever the priority field says.
    f = make("fcfs", max_num_seqs=1)
    add(f, "x", 3, priority=0, arrival=5.0)
    add(f, "y", 3, priority=0, arrival=1.0)
    assert [r.request_id for r in f.waiting] == ["x", "y"]


def test_block_pressure_preempts_the_lowest_priority_running_request():
    def run(policy):
        # 4 blocks of 4 tokens: two 7-token prompts fit (2 blocks each); their 2nd decode
        # step needs a 3rd block each, so one of them must give its blocks back.
        s = make(policy, num_blocks=5)  # one block is the null block
        add(s, "low", 7, priority=5, arrival=0.0, max_tokens=6)
        add(s, "high", 7, priority=0, arrival=1.0, max_tokens=6)
        preempted = []
        while s.has_unfinished_requests():
            out = s.schedule()
            preempted += [r.request_id for r in s.waiting if r.status == RequestStatus.PREEMPTED
                          and r.request_id not in preempted]
            fake_run(s, out)
        return preempted

    assert run("priority")[0] == "low"
    assert run("fcfs")[0] == "high", "fcfs preempts the newest, as before"


def test_high_priority_arrival_starts_within_one_step_of_a_long_low_priority_prefill():
    s = make(max_num_batched_tokens=10)
    add(s, "low", 40, priority=5)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"low": 10}
    fake_run(s, out)
    add(s, "high", 6, priority=0, arrival=1.0)
    out = s.schedule()
    # The low prefill yields: high's whole prompt runs now, low gets the rest of the budget.
    assert out.num_scheduled_tokens == {"high": 6, "low": 4}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["high"]
    f = make("fcfs", max_num_batched_tokens=10)
    add(f, "low", 40, priority=0)
    fake_run(f, f.schedule())
    add(f, "high", 6, arrival=1.0)
    assert f.schedule().num_scheduled_tokens == {"low": 10}, "fcfs: the running prefill keeps the budget"


def test_a_yielding_prefill_without_blocks_gives_its_blocks_to_the_higher_priority_arrival():
    s = make(num_blocks=11, max_num_batched_tokens=16)  # 10 blocks of 4 tokens
    add(s, "decode", 7, priority=0, max_tokens=100)
    add(s, "low", 40, priority=5, arrival=1.0)
    for expected in ({"decode": 7, "low": 9}, {"decode": 1, "low": 15}):
        out = s.schedule()
        assert out.num_scheduled_tokens == expected
        fake_run(s, out)
    add(s, "high", 12, priority=-1, arrival=2.0)  # 3 blocks; 1 is free
    out = s.schedule()
    # high does not fit; low yields to it and has no blocks for its chunk: it is preempted.
    assert out.num_scheduled_tokens == {"decode": 1}
    assert s.requests["low"].status == RequestStatus.PREEMPTED and "low" in out.finished_req_ids
    fake_run(s, out)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"decode": 1, "high": 12, "low": 3}  # low restarts with the rest
    assert [r.req_id for r in out.scheduled_new_reqs] == ["high", "low"]


def test_max_num_active_seqs_caps_running_but_not_the_batch_size():
    s = make("fcfs", max_num_seqs=8, active=2)
    for r in "abcd":
        add(s, r, 3, max_tokens=2)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert s.max_num_seqs == 8 and len(s.running) == 2
    fake_run(s, out)
    seen = set()
    while s.has_unfinished_requests():
        out = s.schedule()
        assert len(s.running) <= 2
        seen |= set(out.num_scheduled_tokens)
        fake_run(s, out)
    assert seen == set("abcd")


def test_max_num_active_seqs_must_not_exceed_max_num_seqs():
    from pagedllm.config import EngineArgs

    with pytest.raises(ValueError, match="max_num_active_seqs must be between 1 and max_num_seqs"):
        SchedulerConfig.from_engine_args(EngineArgs(max_num_seqs=4, max_num_active_seqs=5), 128)


def test_priority_queue_remove_keeps_the_order():
    s = make()
    for i, prio in enumerate([3, 1, 2, 0]):
        add(s, f"r{i}", 3, priority=prio, arrival=float(i))
    queue = s.waiting
    assert isinstance(queue, PriorityRequestQueue)
    queue.remove_request(s.requests["r2"])
    assert [r.request_id for r in queue] == ["r3", "r1", "r0"]
    s.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    assert [queue.pop_request().request_id for _ in range(len(queue))] == ["r3", "r0"]
