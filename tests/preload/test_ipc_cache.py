"""Preloaded weights (``pagedllm.preload``): a store written as ``pagedllm preload`` writes it,
engines that map it (``--load-format ipc_cache``) give transformers' greedy tokens and share
one copy of its pages, each field of the cache key that differs is named, a daemon that
stops (deleting its stores) leaves the engines that map them serving, and an engine of the same
settings reuses the activation peak the first one measured (no profiling run)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams, envs
from pagedllm.config import EngineArgs
from pagedllm.preload import daemon
from pagedllm.model_executor.layers.cpu_gemm import pack_weight
from pagedllm.preload import ipc_cache
from pagedllm.preload.store import PROFILE_FILE, WEIGHTS_FILE
from tests.helpers import as_tensor_parallel_rank, check_block_accounting, hf_greedy

PROMPT = [1, 5, 9, 200, 31, 77, 3]
ARGS = {"dtype": "float32", "max_model_len": 64}


@pytest.fixture(scope="module")
def store(tiny_llama, tmp_path_factory):
    """The store of ``tiny_llama`` (float32) in a private PAGEDLLM_PRELOAD_DIR; yields its folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDLLM_PRELOAD_DIR", str(tmp_path_factory.mktemp("preload")))
        (directory,) = daemon.preload_model(EngineArgs(model=str(tiny_llama), **ARGS))
        yield directory


def _model_config(tiny_llama: Path, **changes):
    config = EngineArgs(model=str(tiny_llama), **ARGS).create_engine_config(log_choices=False).model_config
    return dataclasses.replace(config, **changes)


def _load(model_config, required: bool = True):
    return ipc_cache.load_preloaded(model_config, required, pack_weight)


def test_each_key_field_that_differs_is_named(store, tiny_llama, monkeypatch):
    assert _load(_model_config(tiny_llama)) is not None
    cases = [
        ({"dtype": __import__("torch").bfloat16}, "dtype (preloaded: 'float32', this engine: 'bfloat16')"),
        ({"quantization": "int8"}, "quantization (preloaded: None, this engine: 'int8')"),
    ]
    for changes, named in cases:
        with pytest.raises(ValueError, match=f"do not match this engine: {named.replace('(', '.').replace(')', '.')}"):
            _load(_model_config(tiny_llama, **changes))
    with monkeypatch.context() as patch:
        patch.setenv("PAGEDLLM_CPU_ISA", "portable")
        with pytest.raises(ValueError, match="isa .preloaded: 'avx"):
            _load(_model_config(tiny_llama))
    with monkeypatch.context() as patch:  # the loader lays weights out for the kernels, or not
        stored_on = not envs.PAGEDLLM_DISABLE_CPU_KERNELS.get()
        patch.setenv("PAGEDLLM_DISABLE_CPU_KERNELS", "1" if stored_on else "0")
        with pytest.raises(ValueError, match=f"cpu_kernels .preloaded: {stored_on}, this engine: {not stored_on}"):
            _load(_model_config(tiny_llama))
    with monkeypatch.context() as patch:
        patch.setattr("pagedllm.version.__version__", "0.0.1")
        with pytest.raises(ValueError, match="pagedllm_version"):
            _load(_model_config(tiny_llama))
    with monkeypatch.context() as patch:
        as_tensor_parallel_rank(patch, 0, 2)
        with pytest.raises(ValueError, match="tensor_parallel_size .preloaded: 1, this engine: 2"):
            _load(_model_config(tiny_llama))
    config_json = tiny_llama / "config.json"
    stat = config_json.stat()
    try:
        os.utime(config_json, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
        with pytest.raises(ValueError, match="files: config.json"):
            _load(_model_config(tiny_llama))
    finally:
        os.utime(config_json, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_auto_warns_and_loads_the_checkpoint_on_a_mismatch(store, tiny_llama, caplog, monkeypatch):
    monkeypatch.setattr("pagedllm.version.__version__", "0.0.1")
    assert _load(_model_config(tiny_llama, load_format="auto"), required=False) is None
    assert "do not match this engine (pagedllm_version" in caplog.text
    monkeypatch.setenv("PAGEDLLM_PRELOAD_DIR", str(store.parent / "elsewhere"))
    with pytest.raises(ValueError, match="no preloaded weights of .* start `pagedllm preload"):
        _load(_model_config(tiny_llama))


def _mapped_inode(llm: LLM) -> int:
    """The inode of the file that the engine's embedding weight is mapped from (0: anonymous memory)."""
    ptr = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model.model.embed_tokens.weight.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= ptr < end:
            return int(line.split()[4])
    raise AssertionError("the weight is in no mapping")


def test_engines_share_the_store_and_outlive_the_daemon(store, tiny_llama):
    expected = hf_greedy(tiny_llama, PROMPT, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engines = [LLM(str(tiny_llama), load_format="ipc_cache", num_gpu_blocks_override=16, **ARGS) for _ in range(2)]
    inode = (store / WEIGHTS_FILE).stat().st_ino
    for llm in engines:
        assert llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids == expected
        assert _mapped_inode(llm) == inode  # both view the store's one copy
    root = store.parent
    server = threading.Thread(target=daemon.serve_control, args=(root,), daemon=True)
    server.start()
    try:
        deadline, status = time.monotonic() + 30, None
        while status is None and time.monotonic() < deadline:  # until the thread listens
            status = daemon.control(root, "status")
            time.sleep(0.01)
        assert status["stores"] == 1 and status["nbytes"] > 0
        assert [s["model_path"] for s in daemon.control(root, "list")["stores"]] == [str(tiny_llama.resolve())]
        assert daemon.control(root, "stop")["stopped"] is True
    finally:
        server.join(timeout=30)
    assert not store.exists() and daemon.control(root, "status") is None  # stores deleted, socket gone
    for llm in engines:  # the deleted file's pages stay while mapped
        assert llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids == expected
        check_block_accounting(llm)


def test_the_profiled_activation_peak_is_recorded_beside_the_store(tiny_llama, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDLLM_PRELOAD_DIR", str(tmp_path))
    (store,) = daemon.preload_model(EngineArgs(model=str(tiny_llama), **ARGS))
    expected = hf_greedy(tiny_llama, PROMPT, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert not (store / PROFILE_FILE).exists()
    first = LLM(str(tiny_llama), load_format="ipc_cache", **ARGS)
    recorded = json.loads((store / PROFILE_FILE).read_text())
    assert recorded["activation_peak"] > 0 and recorded["inputs"]["max_model_len"] == 64
    assert "recorded beside the store" not in caplog.text
    second = LLM(str(tiny_llama), load_format="ipc_cache", **ARGS)
    assert "recorded beside the store (no profiling run)" in caplog.text
    assert second.llm_engine.engine_core.num_gpu_blocks == first.llm_engine.engine_core.num_gpu_blocks
    for llm in (first, second):
        assert llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids == expected
        check_block_accounting(llm)
    caplog.clear()
    LLM(str(tiny_llama), load_format="ipc_cache", max_num_seqs=8, **ARGS)  # other settings: profiled again
    assert "recorded beside the store" not in caplog.text
    assert json.loads((store / PROFILE_FILE).read_text())["inputs"] != recorded["inputs"]
