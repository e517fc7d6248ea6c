"""The scheduler never runs more than ``max_loras`` distinct LoRA adapters at once; a request
waiting for a slot keeps its place (only base-model requests pass it), so it is not starved;
``SchedulerStats`` names the running and waiting adapters."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import first_block_extra_keys
from pagedllm.core.scheduler import Scheduler
from pagedllm.lora.request import LoRARequest
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import fake_run


def make(max_loras):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    return Scheduler(config, KVCacheManager(64, 4, enable_caching=False), max_loras)


def add(s, req_id, lora_id, max_tokens=3):
    lora = None if lora_id is None else LoRARequest(f"lora{lora_id}", lora_id, "/x")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    s.add_request(EngineCoreRequest(req_id, [1, 2, 3], params, 0, 0.0, lora_request=lora))


def running_loras(s):
    return {r.lora_key[1] for r in s.running if r.lora_key is not None}


def test_at_most_max_loras_adapters_run_and_none_starves():
    s = make(max_loras=2)
    for req_id, lora in [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", None), ("f", 4)]:
        add(s, req_id, lora)
    out = s.schedule()
    # c (adapter 3) waits for a slot; behind it only the base request e may start (not d).
    assert list(out.num_scheduled_tokens) == ["a", "b", "e"]
    assert [r.request_id for r in s.waiting] == ["c", "d", "f"]
    stats = s.make_stats()
    assert stats.running_lora_adapters == ["lora1", "lora2"]
    assert stats.waiting_lora_adapters == ["lora1", "lora3", "lora4"]
    fake_run(s, out)  # a step's requests are in flight until its output is back
    finished, seen = set(), []
    while s.has_unfinished_requests():
        out = s.schedule()
        assert len(running_loras(s)) <= 2
        seen += [r for r in out.num_scheduled_tokens if r not in seen]
        finished |= {o.request_id for o in fake_run(s, out).outputs if o.finished}
    assert finished == set("abcdef")
    assert seen.index("c") < seen.index("f")  # FCFS among adapters


def test_without_lora_limit_everything_starts():
    s = make(max_loras=None)
    for req_id, lora in [("a", 1), ("b", 2), ("c", 3)]:
        add(s, req_id, lora)
    assert list(s.schedule().num_scheduled_tokens) == ["a", "b", "c"]
    assert s.make_stats().running_lora_adapters == []


def test_first_block_keys_separate_adapters_and_generations():
    assert first_block_extra_keys(None, None) is None
    assert first_block_extra_keys("salt", None) == ("salt",)
    one = LoRARequest("a", 1, "/x")
    reloaded = LoRARequest("a", 1, "/x", load_generation=5)
    keys = {first_block_extra_keys(None, r.adapter_key) for r in (one, reloaded, LoRARequest("a", 2, "/x"))}
    assert len(keys) == 3
