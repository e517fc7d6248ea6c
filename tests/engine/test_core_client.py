"""EngineCore clients: in-process, and in a background process over ZeroMQ (protocol,
utility calls, aborts, scheduling events, start-up errors, engine death)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.core_client import InprocClient, MPClient
from pagedllm.engine.core_proc import EngineCoreRequestType
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.messages.engine_core import EngineCoreEventType, EngineCoreOutputs
from pagedllm.engine.processor import Processor
from pagedllm.tokenizer import get_tokenizer
from pagedllm.worker.kv_cache_sizing import kv_bytes_per_token

KV_BYTES = 8 << 20


def make_config(path, **kwargs):
    kwargs.setdefault("kv_cache_memory_bytes", KV_BYTES)
    return EngineArgs(model=str(path), dtype="float32", **kwargs).create_engine_config()


def make_processor(config) -> Processor:
    return Processor(config.model_config, get_tokenizer(config.model_config.tokenizer_path))


def run_to_completion(client, num_requests: int, max_steps: int = 10_000) -> dict[str, list]:
    """Step until ``num_requests`` requests finished; returns id -> [token ids, events, reason]."""
    results: dict[str, list] = {}
    finished = 0
    for _ in range(max_steps):
        outputs: EngineCoreOutputs = client.get_output()
        for output in outputs.outputs:
            entry = results.setdefault(output.request_id, [[], [], None])
            entry[0] += output.new_token_ids
            entry[1] += output.events or []
            if output.finished:
                entry[2] = output.finish_reason
                finished += 1
        if finished == num_requests:
            return results
    raise AssertionError("requests did not finish")


def check_inproc_idle(client: InprocClient) -> None:
    pool = client.engine_core.kv_cache_manager.block_pool
    pool.check_integrity()
    assert not client.engine_core.has_unfinished_requests()
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_inproc_client_matches_llm_and_reports_events(tiny_llama):
    config = make_config(tiny_llama)
    client = InprocClient(config)
    processor = make_processor(config)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["Hello there", "The quick brown fox"]
    for i, prompt in enumerate(prompts):
        request, _ = processor.process(f"r{i}", prompt, params)
        client.add_request(request)
    results = run_to_completion(client, len(prompts))
    expected = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES).generate(
        prompts, params, use_tqdm=False
    )
    for i, ref in enumerate(expected):
        tokens, events, reason = results[f"r{i}"]
        assert tokens == ref.outputs[0].token_ids
        assert str(reason) == "length"
        assert [e.type for e in events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
        assert events[0].timestamp <= events[1].timestamp <= time.time()
    assert client.reset_prefix_cache()
    check_inproc_idle(client)


def test_preemption_is_reported_as_an_event(tiny_llama):
    # 5 blocks of 16 tokens; each request grows to 4 blocks, so the second is preempted.
    probe = make_config(tiny_llama, max_model_len=64)
    block_bytes = kv_bytes_per_token(probe.model_config) * 16
    config = make_config(tiny_llama, max_model_len=64, kv_cache_memory_bytes=5 * block_bytes)
    client = InprocClient(config)
    processor = make_processor(config)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(2):
        request, _ = processor.process(f"p{i}", list(range(10 + i, 30 + i)), params)
        client.add_request(request)
    results = run_to_completion(client, 2)
    types = [e.type for r in results.values() for e in r[1]]
    assert EngineCoreEventType.PREEMPTED in types
    # a preempted request is scheduled again: one more SCHEDULED than requests
    assert types.count(EngineCoreEventType.SCHEDULED) == 2 + types.count(EngineCoreEventType.PREEMPTED)
    assert all(len(r[0]) == 40 for r in results.values())
    check_inproc_idle(client)


def test_mp_client_serves_aborts_and_notices_death(tiny_llama):
    config = make_config(tiny_llama)
    processor = make_processor(config)
    client = MPClient(config)
    try:
        assert client.num_gpu_blocks > 0
        assert client.engine_pid != os.getpid()
        short, _ = processor.process(
            "short", "Hi", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        )
        long, _ = processor.process("long", "Hey", SamplingParams(max_tokens=1500, ignore_eos=True))
        client.add_request(short)
        client.add_request(long)
        seen_long = 0
        while True:
            outputs = client.get_output(timeout_s=30)
            seen_long += sum(len(o.new_token_ids) for o in outputs.outputs if o.request_id == "long")
            if any(o.request_id == "short" and o.finished for o in outputs.outputs):
                break
        # "long" ran beside "short": it may arrive one step after "short" started, so by the
        # step that gives "short" its 4th token it has at least 3 tokens
        assert seen_long >= 3
        # the engine refuses to reset the prefix cache while "long" holds blocks
        assert client.reset_prefix_cache() is False
        client.abort_requests(["long", "unknown-id"])
        deadline = time.monotonic() + 2
        while True:  # a stats-only message follows the abort even though the engine is idle
            stats = client.get_output(timeout_s=2).scheduler_stats
            if stats is not None and stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0:
                break
            assert time.monotonic() < deadline
        accounting = client.call_utility("block_accounting")
        assert accounting["num_free_blocks"] == accounting["num_blocks"] == client.num_gpu_blocks
        assert accounting["num_unfinished_requests"] == 0
        assert client.reset_prefix_cache() is True
        with pytest.raises(RuntimeError, match="unknown EngineCore utility"):
            client.call_utility("model_runner")

        client.add_request(long)
        client.get_output(timeout_s=30)
        os.kill(client.engine_pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            while True:
                client.get_output(timeout_s=5)
        assert time.monotonic() - start < 2
        assert client.is_dead
        with pytest.raises(EngineDeadError):
            client.add_request(short)
        client.abort_requests(["long"])  # a no-op on a dead engine
    finally:
        client.shutdown()
    assert not os.path.exists(client._directory)


def test_startup_error_propagates(tiny_llama):
    """The engine's start-up error arrives through the handshake with its message (engine
    in a thread here; tests/engine/test_async_llm.py does the same with a process)."""
    # one max_model_len (2048-token) sequence needs 128 blocks; give it 2
    config = make_config(tiny_llama)
    config.cache_config = dataclasses.replace(
        config.cache_config, kv_cache_memory_bytes=2 * 16 * kv_bytes_per_token(config.model_config)
    )
    with pytest.raises(ValueError, match="KV cache cannot hold one sequence") as info:
        MPClient(config, engine_in_thread=True)
    assert "kv_cache_sizing" in str(info.value.__cause__)  # the engine's traceback rides along


def test_engine_failure_is_reported_not_hung(tiny_llama):
    """An exception in the engine loop reaches the client as EngineDeadError carrying the
    engine's error (engine in a thread here: same loop and protocol, no process start)."""
    config = make_config(tiny_llama)
    client = MPClient(config, engine_in_thread=True)
    try:
        request, _ = make_processor(config).process("ok", "Hi", SamplingParams(max_tokens=2, ignore_eos=True))
        client.add_request(request)
        while not any(o.finished for o in client.get_output(timeout_s=30).outputs):
            pass
        client._send(EngineCoreRequestType.ADD, b"not msgpack")  # a message the engine cannot decode
        with pytest.raises(EngineDeadError, match="engine core failed: .*Error") as info:
            while True:
                client.get_output(timeout_s=5)
        assert "Traceback" in str(info.value.__cause__)
        assert client.is_dead
    finally:
        client.shutdown()
