"""AsyncLLM with the EngineCore in its own process: outputs equal the offline LLM's,
streaming, cancellation frees blocks, engine death fails requests, start-up errors."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.sampling_params import RequestOutputKind

KV_BYTES = 8 << 20
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "日本語のテキスト",
    [5, 17, 300, 42, 7, 99, 512, 3, 8],
]


def engine_args(path, **kwargs) -> EngineArgs:
    kwargs.setdefault("kv_cache_memory_bytes", KV_BYTES)
    return EngineArgs(model=str(path), dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def async_llm(tiny_llama):
    llm = AsyncLLM.from_engine_args(engine_args(tiny_llama))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference_llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES)


def metric(llm: AsyncLLM, name: str, **labels) -> float:
    labels = {"model_name": llm.served_model_name, "engine": "0", **labels}
    value = llm.metrics_registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def check_idle(llm: AsyncLLM, timeout_s: float = 1.0) -> None:
    """The block-accounting check in the engine, after its last step: nothing runs or
    waits, every block is free, and the gauges say so."""
    deadline = time.monotonic() + timeout_s
    while True:
        accounting = await llm.engine_core.call_utility_async("block_accounting")
        gauges = [
            metric(llm, f"pagedllm:{g}")
            for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        ]
        idle = (
            accounting["num_free_blocks"] == accounting["num_blocks"]
            and accounting["num_unfinished_requests"] == 0
            and accounting["num_requests_holding_blocks"] == 0
            and gauges == [0.0, 0.0, 0.0]
        )
        if idle:
            break
        assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {accounting}, gauges {gauges}"
        await asyncio.sleep(0.02)
    assert llm.get_num_unfinished_requests() == 0


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str):
    outputs = []
    async for output in llm.generate(prompt, params, request_id):
        outputs.append(output)
    return outputs


def test_greedy_matches_offline_llm(async_llm, reference_llm):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = reference_llm.generate(PROMPTS, params, use_tqdm=False)

    async def main():
        final_only = params.clone()
        final_only.output_kind = RequestOutputKind.FINAL_ONLY
        results = await asyncio.gather(
            *[collect(async_llm, p, final_only, f"greedy-{i}") for i, p in enumerate(PROMPTS)]
        )
        await check_idle(async_llm)
        return results

    results = asyncio.run(main())
    for outputs, ref in zip(results, expected):
        assert len(outputs) == 1 and outputs[0].finished
        assert outputs[0].prompt_token_ids == ref.prompt_token_ids
        assert outputs[0].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outputs[0].outputs[0].text == ref.outputs[0].text
        assert outputs[0].outputs[0].finish_reason == ref.outputs[0].finish_reason


def test_streaming_delta_joins_to_final(async_llm, reference_llm):
    params = SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, n=2, output_kind=RequestOutputKind.DELTA
    )
    final = reference_llm.generate(
        PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )

    async def main():
        results = await asyncio.gather(
            *[collect(async_llm, p, params, f"delta-{i}") for i, p in enumerate(PROMPTS[:3])]
        )
        cumulative = await collect(
            async_llm,
            PROMPTS[0],
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            "cumulative",
        )
        await check_idle(async_llm)
        return results, cumulative

    results, cumulative = asyncio.run(main())
    for outputs, ref in zip(results, final):
        assert len(outputs) > 1 and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        for index in range(2):
            chunks = [c for o in outputs for c in o.outputs if c.index == index]
            assert "".join(c.text for c in chunks) == ref.outputs[0].text
            assert [t for c in chunks for t in c.token_ids] == ref.outputs[0].token_ids
            assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    # CUMULATIVE: every output holds everything so far.
    texts = [o.outputs[0].text for o in cumulative]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == final[0].outputs[0].text


def test_cancel_mid_stream_frees_blocks(async_llm):
    params = SamplingParams(
        temperature=0.0, max_tokens=1500, ignore_eos=True, n=2, output_kind=RequestOutputKind.DELTA
    )
    aborted_before = metric(async_llm, "pagedllm:request_success_total", finished_reason="abort")

    async def consume(request_id, started: asyncio.Event):
        async for _ in async_llm.generate("A long story:", params, request_id):
            started.set()

    async def main():
        # 1. the consuming task is cancelled (what a client disconnect does in the server)
        started = asyncio.Event()
        task = asyncio.create_task(consume("cancel-me", started))
        await asyncio.wait_for(started.wait(), 30)
        assert (
            metric(async_llm, "pagedllm:kv_cache_usage_perc") > 0
            or async_llm.get_num_unfinished_requests() == 2
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await check_idle(async_llm, timeout_s=1.0)
        # 2. the consumer closes the generator early
        gen = async_llm.generate("Another long story:", params, "close-me")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()
        await check_idle(async_llm, timeout_s=1.0)
        # 3. abort() from elsewhere: the consumer gets a last output, finish_reason "abort"
        outputs = []

        async def consume_all():
            async for output in async_llm.generate("Third story:", params, "abort-me"):
                outputs.append(output)

        task = asyncio.create_task(consume_all())
        while not outputs:
            await asyncio.sleep(0.01)
        await async_llm.abort("abort-me")
        await asyncio.wait_for(task, 5)
        assert outputs[-1].finished
        assert {c.finish_reason for c in outputs[-1].outputs} == {"abort"}
        await check_idle(async_llm, timeout_s=1.0)

    asyncio.run(main())
    # every one of the n = 2 completions of the three requests was counted as aborted
    assert metric(async_llm, "pagedllm:request_success_total", finished_reason="abort") - aborted_before == 6


def test_event_loop_not_blocked_by_engine(async_llm):
    """While the engine is saturated, the event loop keeps answering (``/health``-like):
    a 10 ms sleep plus a health check overshoots by well under 50 ms (median; the
    machine is shared, so single samples may be late)."""
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)

    async def main():
        ids = [f"busy-{i}" for i in range(len(PROMPTS) * 4)]
        tasks = [asyncio.create_task(collect(async_llm, p, params, i)) for p, i in zip(PROMPTS * 4, ids)]
        await asyncio.sleep(0.2)
        delays = []
        for _ in range(21):
            start = time.monotonic()
            await async_llm.check_health()
            await asyncio.sleep(0.01)
            delays.append(time.monotonic() - start - 0.01)
        still_busy = async_llm.get_num_unfinished_requests()
        await async_llm.abort(ids)
        await asyncio.gather(*tasks)
        await check_idle(async_llm)
        return sorted(delays), still_busy

    delays, still_busy = asyncio.run(main())
    assert still_busy > 0, "the engine finished before the measurement ended"
    assert delays[len(delays) // 2] < 0.05, f"event-loop delays (s): {delays}"


def test_invalid_requests_raise_before_queueing(async_llm):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await collect(async_llm, [], SamplingParams(), "empty")
        with pytest.raises(ValueError, match="maximum context length"):
            await collect(async_llm, "hi", SamplingParams(max_tokens=10**6), "too-long")
        with pytest.raises(ValueError, match="out of vocabulary"):
            await collect(async_llm, [10**6], SamplingParams(), "oov")
        gen = async_llm.generate("x", SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await gen.__anext__()
        with pytest.raises(ValueError, match="already running"):
            await collect(async_llm, "y", SamplingParams(), "dup")
        await gen.aclose()
        await check_idle(async_llm)
        await async_llm.reset_prefix_cache()
        # after the errors, the engine still serves
        outputs = await collect(
            async_llm, "ok", SamplingParams(max_tokens=3, ignore_eos=True), "after-errors"
        )
        assert len(outputs[-1].outputs[0].token_ids) == 3

    asyncio.run(main())


def test_engine_death_fails_requests(tiny_llama):
    llm = AsyncLLM.from_engine_args(engine_args(tiny_llama))
    try:
        assert llm.is_running and not llm.errored and llm.engine_pid != os.getpid()
        params = SamplingParams(max_tokens=1800, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

        async def main():
            gen = llm.generate("doomed", params, "doomed")
            await gen.__anext__()
            os.kill(llm.engine_pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
            elapsed = time.monotonic() - start
            assert llm.errored and not llm.is_running
            with pytest.raises(EngineDeadError):
                await llm.check_health()
            with pytest.raises(EngineDeadError):
                await collect(llm, "after", SamplingParams(), "after")
            return elapsed

        assert asyncio.run(main()) < 5.0
    finally:
        llm.shutdown()


def test_bad_model_fails_fast_with_clear_error(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="not a local directory"):
        AsyncLLM.from_engine_args(engine_args(tmp_path / "missing"))
    # A checkpoint whose architecture pagedllm does not implement: the engine process
    # fails while loading, and its error reaches us as a ValueError with its message.
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    with pytest.raises(ValueError, match="NoSuchModelForCausalLM") as info:
        AsyncLLM.from_engine_args(engine_args(bad))
    assert time.monotonic() - start < 60
    assert "Traceback" in str(info.value.__cause__)  # the engine's traceback rides along


def test_dtype_auto_choice_is_logged_once(tiny_llama, caplog):
    """The front end and the engine both resolve the ``EngineArgs`` (the engine in a thread
    here, so both log into this process): the ``--dtype auto`` line appears once."""
    caplog.set_level(logging.INFO, logger="pagedllm.config")
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=str(tiny_llama), dtype="auto", kv_cache_memory_bytes=KV_BYTES), multiprocess=False
    )
    llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--dtype auto")]
    assert lines == ["--dtype auto: bfloat16 (16-bit for a float32 checkpoint, as vLLM)"]


def test_built_before_the_engine_is_ready(tiny_llama, reference_llm):
    """``wait_for_ready=False`` (``pagedllm serve`` builds its app meanwhile): the tokenizer
    and processor are there at once; ``wait_for_ready`` then registers the metrics with the
    engine's KV-cache blocks, and the first request is served as the offline LLM's."""
    from pagedllm.engine.client_factory import make_client

    config = engine_args(tiny_llama).create_engine_config()
    engine_core = make_client(config, multiprocess=True, asyncio_mode=True, wait_for_ready=False)
    llm = AsyncLLM(config, engine_core=engine_core, wait_for_ready=False)
    try:
        assert llm.stat_logger is None and llm.processor.vocab_size > 0
        assert llm.metrics_registry.get_sample_value("pagedllm:cache_config_info", {"engine": "0"}) is None
        llm.wait_for_ready()
        llm.wait_for_ready()  # once
        blocks = [s.labels["num_gpu_blocks"] for m in llm.metrics_registry.collect() if m.name == "pagedllm:cache_config_info"
                  for s in m.samples]
        assert blocks == [str(engine_core.num_gpu_blocks)] and engine_core.num_gpu_blocks > 0
        params = SamplingParams(temperature=0.0, max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY)
        outputs = asyncio.run(collect(llm, PROMPTS[0], params, "first"))
        expected = reference_llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
        assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_start_failure_is_raised_by_wait_for_ready(tiny_llama, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    from pagedllm.engine.client_factory import make_client

    engine_args_ = engine_args(bad)
    llm = AsyncLLM(engine_args_.create_engine_config(),
                   engine_core=make_client(engine_args_, multiprocess=True, asyncio_mode=True, wait_for_ready=False),
                   wait_for_ready=False)
    with pytest.raises(ValueError, match="NoSuchModelForCausalLM"):
        llm.wait_for_ready()
    assert not llm.is_running
    llm.shutdown()


def test_shutdown_before_ready_stops_the_engine_at_once(tiny_llama):
    """A start given up while the engine loads (e.g. the app could not be built): the
    engine, which reads no SHUTDOWN before it is ready, is terminated without the 5 s wait."""
    from pagedllm.engine.client_factory import make_client

    config = engine_args(tiny_llama).create_engine_config()
    llm = AsyncLLM(config, engine_core=make_client(config, multiprocess=True, asyncio_mode=True, wait_for_ready=False),
                   wait_for_ready=False)
    process = llm.engine_core.handle.worker
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 3.0 and not process.is_alive()
