"""The executor layer: choosing the executor (``get_executor_class``), and
``UniProcExecutor`` driving its one ``Worker`` (collective_rpc by name and by callable, KV
sizing and allocation, shutdown); ``MultiprocExecutor`` with one worker process (calls,
timeout)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from pagedllm.config import EngineArgs
from pagedllm.executor.abstract import Executor
from pagedllm.executor.multiproc_executor import MultiprocExecutor, WorkerDeadError
from pagedllm.executor.selector import get_executor_class
from pagedllm.executor.uniproc_executor import UniProcExecutor
from pagedllm.worker.kv_cache_sizing import kv_bytes_per_token
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.worker import Worker

KV_BYTES = 4 << 20


def make_config(path, **kwargs):
    return EngineArgs(model=str(path), dtype="float32", **kwargs).create_engine_config()


class _OtherExecutor(Executor):
    def _init_executor(self) -> None:
        pass

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None) -> list:
        return []

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("backend", [None, "uni"])
def test_get_executor_class_uni_for_world_size_one(tiny_llama, backend):
    config = make_config(tiny_llama, distributed_executor_backend=backend)
    assert config.parallel_config.world_size == 1
    assert get_executor_class(config) is UniProcExecutor


def test_get_executor_class_takes_an_executor_subclass(tiny_llama):
    assert get_executor_class(make_config(tiny_llama, distributed_executor_backend=_OtherExecutor)) is _OtherExecutor
    with pytest.raises(TypeError, match="must be an Executor subclass"):
        get_executor_class(make_config(tiny_llama, distributed_executor_backend=Worker))


def test_get_executor_class_external_launcher_not_supported_yet(tiny_llama):
    with pytest.raises(ValueError, match="distributed_executor_backend='external_launcher' is not supported yet"):
        make_config(tiny_llama, distributed_executor_backend="external_launcher")  # EngineArgs refuses it first
    config = make_config(tiny_llama)
    config.parallel_config = dataclasses.replace(config.parallel_config, distributed_executor_backend="external_launcher")
    with pytest.raises(NotImplementedError, match="distributed_executor_backend 'external_launcher' is not supported"):
        get_executor_class(config)


@pytest.mark.parametrize("backend", [None, "mp"])
def test_get_executor_class_multiprocess_for_world_size_above_one(tiny_llama, backend):
    config = make_config(tiny_llama, tensor_parallel_size=2, distributed_executor_backend=backend)
    assert get_executor_class(config) is MultiprocExecutor
    assert get_executor_class(make_config(tiny_llama, distributed_executor_backend="mp")) is MultiprocExecutor


def test_get_executor_class_uni_cannot_run_several_workers(tiny_llama):
    config = make_config(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="'uni' runs one worker, but tensor_parallel_size 2 x pipeline_parallel_size 1 = 2"):
        get_executor_class(config)


def test_get_executor_class_unknown_backend(tiny_llama):
    config = make_config(tiny_llama)
    config.parallel_config = dataclasses.replace(config.parallel_config, distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="Unknown distributed_executor_backend 'threads'"):
        get_executor_class(config)


def test_uniproc_executor_drives_its_worker(tiny_llama):
    config = make_config(tiny_llama, kv_cache_memory_bytes=KV_BYTES)
    executor = UniProcExecutor(config)
    worker = executor.driver_worker
    assert isinstance(worker.model_runner, ModelRunner)
    assert worker.model_runner.weights_bytes > 0  # loaded by the executor's start-up
    block_bytes = kv_bytes_per_token(config.model_config) * config.cache_config.block_size
    assert executor.determine_available_memory() == KV_BYTES
    assert executor.collective_rpc("determine_available_memory") == [KV_BYTES]
    assert executor.determine_num_available_blocks() == KV_BYTES // block_bytes == 512

    assert executor.collective_rpc(lambda w, x, y=0: (w.rank, x, y), args=(5,), kwargs={"y": 6}) == [(0, 5, 6)]
    assert executor.collective_rpc("determine_available_memory", timeout=1.0) == [KV_BYTES]

    executor.initialize_kv_cache(300)
    caches = worker.model_runner.kv_caches
    assert len(caches) == config.model_config.num_layers
    assert caches[0].shape == (2, 300, 16, config.model_config.num_kv_heads, config.model_config.head_dim)

    executor.shutdown()
    assert not hasattr(worker, "model_runner")
    executor.shutdown()  # idempotent
    with pytest.raises(AttributeError, match="model_runner"):
        executor.collective_rpc("load_model")


def test_worker_profiles_once_for_a_memory_share(tiny_llama, monkeypatch):
    """Without kv_cache_memory_bytes the budget is utilization x memory at start-up -
    weights - activation peak, profiled once for both questions."""
    peaks = []

    def fake_profile_run(runner: ModelRunner) -> int:
        peaks.append(3 << 20)
        return peaks[-1]

    monkeypatch.setattr(ModelRunner, "profile_run", fake_profile_run)
    config = make_config(tiny_llama, gpu_memory_utilization=0.5)
    config.cache_config = dataclasses.replace(config.cache_config, max_kv_cache_tokens=None)  # the CPU cap by demand: test_model_loading.py
    executor = UniProcExecutor(config)
    worker = executor.driver_worker
    expected = int(0.5 * worker.memory_before_load) - worker.model_runner.weights_bytes - (3 << 20)
    assert executor.determine_available_memory() == expected
    block_bytes = kv_bytes_per_token(config.model_config) * config.cache_config.block_size
    assert executor.determine_num_available_blocks() == expected // block_bytes
    assert peaks == [3 << 20]


def _rank_and_driver(worker) -> tuple[int, bool]:
    return worker.rank, worker.is_driver_worker


def _sleep(worker, seconds: float) -> None:
    import time

    time.sleep(seconds)


def test_multiproc_executor_calls_its_worker_process_and_times_out(tiny_llama):
    """``"mp"`` with one worker: a process of its own (no torch.distributed); calls by name
    and by callable; a call past its timeout raises, and the executor stops its workers."""
    config = make_config(tiny_llama, kv_cache_memory_bytes=KV_BYTES, distributed_executor_backend="mp")
    executor = MultiprocExecutor(config)
    try:
        (pid,) = executor.worker_pids
        assert pid != os.getpid()
        assert executor.collective_rpc(_rank_and_driver) == [(0, True)]
        assert executor.determine_num_available_blocks() == 512
        with pytest.raises(TimeoutError, match=r"Workers of ranks \[0\] did not answer _sleep within 0.5 s"):
            executor.collective_rpc(_sleep, args=(30,), timeout=0.5)
        assert not executor.workers[0].process.is_alive()
        with pytest.raises(WorkerDeadError, match="The workers stopped earlier: Workers of ranks"):
            executor.collective_rpc("determine_available_memory")
    finally:
        executor.shutdown()
    executor.shutdown()  # idempotent
