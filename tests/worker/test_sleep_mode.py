"""Sleep mode offline (``LLM.sleep`` / ``wake_up``, ``pagedllm.worker.sleep_mode``): the same
greedy tokens after each level, the weights and the KV cache out of memory while asleep."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.exceptions import EngineSleepingError
from pagedllm.worker import sleep_mode
from tests.helpers import check_block_accounting

PROMPTS = [[1, 5, 9, 200, 31], [7, 7, 300, 12, 90, 4, 61, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.model_executor.driver_worker.model_runner


def test_sleep_levels_keep_greedy_output(tiny_llama):
    llm = LLM(str(tiny_llama), enable_sleep_mode=True, dtype="float32", max_model_len=64, num_gpu_blocks_override=32)
    expected = _tokens(llm)
    runner = _runner(llm)
    weights = sleep_mode.weight_storages([runner.model]).storages
    kv_bytes = sum(t.untyped_storage().nbytes() for t in runner.kv_caches)
    assert kv_bytes > 0 and sum(s.nbytes() for s in weights) > 0
    for level in (1, 2):
        llm.sleep(level=level)
        assert llm.llm_engine.is_sleeping()
        assert all(s.nbytes() == 0 for s in weights), "a weight storage is still in memory"
        assert all(layer.kv_cache.numel() == 0 for layer in runner.attention_layers) and runner.kv_caches == []
        with pytest.raises(EngineSleepingError, match="wake_up"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
        llm.wake_up(tags=["weights"])
        assert llm.llm_engine.is_sleeping() and all(s.nbytes() > 0 for s in weights)
        llm.wake_up()
        assert not llm.llm_engine.is_sleeping()
        assert _tokens(llm) == expected, f"level {level}"
        check_block_accounting(llm)
    with pytest.raises(ValueError, match="Unknown wake_up tags"):
        llm.wake_up(tags=["weight"])
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
