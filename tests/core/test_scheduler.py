"""Scheduler decisions with a fake model runner (plain Python)."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages.engine_core import EngineCoreRequest, FinishReason, LogprobsLists
from pagedllm.sampling_params import SamplingParams
from pagedllm.messages.runner_output import ModelRunnerOutput


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, block_size=4, caching=False):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=128)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=caching))


def add(scheduler, req_id, num_prompt, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(EngineCoreRequest(req_id, list(range(1, num_prompt + 1)), params, 0, 0.0))


def fake_run(scheduler, output, token=7):
    """Every request whose known tokens are now all computed samples ``token``."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for r in req_ids:
        request = scheduler.requests[r]
        sampled.append([token] if request.num_computed_tokens == request.num_tokens else [])
    runner_output = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
    return scheduler.update_from_output(output, runner_output)


def test_long_prompt_is_chunked_and_decodes_share_the_step():
    s = make_scheduler(max_num_batched_tokens=10)
    add(s, "short", 3)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"short": 3}
    fake_run(s, out)
    add(s, "long", 25)
    out = s.schedule()
    # The running decode comes first (1 token), then 9 tokens of the long prompt.
    assert out.num_scheduled_tokens == {"short": 1, "long": 9}
    assert out.total_num_scheduled_tokens == 10
    fake_run(s, out)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"short": 1, "long": 9}
    engine_outputs = fake_run(s, out)
    assert [o.request_id for o in engine_outputs.outputs] == ["short"]  # long is mid-prompt
    out = s.schedule()
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}
    assert [o.request_id for o in fake_run(s, out).outputs] == ["short", "long"]


def test_max_num_seqs_and_fcfs():
    s = make_scheduler(max_num_seqs=2)
    for r in "abc":
        add(s, r, 5)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preemption_takes_the_newest_request_and_requeues_it_first():
    # 6 blocks of 4 tokens; three 7-token prompts take 2 blocks each; the first decode
    # past token 8 needs a 7th block.
    s = make_scheduler(num_blocks=6, block_size=4)
    for r in "abc":
        add(s, r, 7, max_tokens=6)
    fake_run(s, s.schedule())
    fake_run(s, s.schedule())  # tokens 8: fits in the second block
    out = s.schedule()  # token 9 needs a third block for a: c (newest) is preempted
    assert s.num_preemptions == 1
    assert "c" not in out.num_scheduled_tokens
    assert s.waiting[0].request_id == "c" and s.waiting[0].status == RequestStatus.PREEMPTED
    assert s.waiting[0].num_computed_tokens == 0
    assert "c" in s.finished_req_ids or "c" in out.finished_req_ids
    fake_run(s, out)
    while s.has_unfinished_requests():
        fake_run(s, s.schedule())
    s.kv_cache_manager.block_pool.check_integrity()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 6


def test_abort_anywhere_frees_blocks():
    s = make_scheduler(max_num_seqs=1)
    add(s, "running", 5)
    add(s, "waiting", 5)
    fake_run(s, s.schedule())
    s.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64
    out = s.schedule()
    assert out.finished_req_ids == {"running", "waiting"} and out.is_empty


def test_stats_report_prefix_cache_tokens_and_preemptions_per_step():
    s = make_scheduler(caching=True)
    add(s, "a", 9)
    fake_run(s, s.schedule())
    add(s, "b", 9)
    out = s.schedule()
    stats = fake_run(s, out).scheduler_stats
    assert stats.prefix_cache_queries == 9 and stats.prefix_cache_hits == 8
    assert stats.num_running_reqs == 2 and stats.num_waiting_reqs == 0
    assert 0 < stats.kv_cache_usage < 1


# --- several tokens per request in one step (speculative decoding) ---------------------

EOS = 2


def run_one_prefill(scheduler, req_id, num_prompt=5, eos=EOS, **params):
    """Admit a request and compute its prompt; returns the scheduler output of that step."""
    params.setdefault("max_tokens", 16)
    scheduler.add_request(
        EngineCoreRequest(req_id, list(range(10, 10 + num_prompt)), SamplingParams(**params), eos, 0.0))
    return scheduler.schedule()


def multi_token_run(scheduler, output, tokens, logprobs=None):
    """Every scheduled request brings all of ``tokens`` (logprobs rows 0.. for request 0)."""
    req_ids = list(output.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                                      [list(tokens) for _ in req_ids], logprobs=logprobs,
                                      logprobs_index={0: 0} if logprobs else {})
    return scheduler.update_from_output(output, runner_output).outputs[0]


def test_several_tokens_are_all_appended_when_none_stops():
    s = make_scheduler()
    out = run_one_prefill(s, "a")
    result = multi_token_run(s, out, [20, 21, 22])
    request = s.requests["a"]
    assert result.new_token_ids == [20, 21, 22] and result.finish_reason is None
    assert request.output_token_ids == [20, 21, 22]
    assert request.num_tokens == 8 and request.num_computed_tokens == 5
    # The next step computes the three new tokens.
    assert s.schedule().num_scheduled_tokens == {"a": 3}


def test_eos_in_the_middle_stops_and_drops_the_rest():
    s = make_scheduler()
    out = run_one_prefill(s, "a")
    logprobs = LogprobsLists([[20], [EOS], [30]], [[-0.1], [-0.2], [-0.3]], [1, 1, 1])
    result = multi_token_run(s, out, [20, EOS, 30], logprobs)
    assert result.new_token_ids == [20, EOS]
    assert result.finish_reason == FinishReason.STOP and result.stop_reason is None
    assert result.new_logprobs.token_ids == [[20], [EOS]] and result.new_logprobs.ranks == [1, 1]
    assert "a" not in s.requests and s.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_stop_token_id_in_the_middle_is_the_stop_reason():
    s = make_scheduler()
    out = run_one_prefill(s, "a", stop_token_ids=[21])
    result = multi_token_run(s, out, [20, 21, 22, 23])
    assert result.new_token_ids == [20, 21]
    assert result.finish_reason == FinishReason.STOP and result.stop_reason == 21


def test_eos_before_min_tokens_does_not_stop():
    s = make_scheduler()
    out = run_one_prefill(s, "a", min_tokens=3)
    result = multi_token_run(s, out, [EOS, 20, EOS, 21])
    assert result.new_token_ids == [EOS, 20, EOS]
    assert result.finish_reason == FinishReason.STOP


def test_max_tokens_mid_list_caps_the_length():
    s = make_scheduler()
    out = run_one_prefill(s, "a", max_tokens=2)
    result = multi_token_run(s, out, [20, 21, 22])
    assert result.new_token_ids == [20, 21] and result.finish_reason == FinishReason.LENGTH


def test_max_model_len_mid_list_caps_the_length():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=7)
    s = Scheduler(config, KVCacheManager(16, 4, enable_caching=False))
    out = run_one_prefill(s, "a", max_tokens=None)
    result = multi_token_run(s, out, [20, 21, 22, 23])
    assert result.new_token_ids == [20, 21] and result.finish_reason == FinishReason.LENGTH
    s.kv_cache_manager.block_pool.check_integrity()
