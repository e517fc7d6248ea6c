"""The CPU profiling run's memory measure (``pagedllm.platforms.cpu_memory``): a buffer freed
before the end counts, even after a higher peak; pages of a mapped file do not; and the
profiling run of weights mapped from a store (``--load-format ipc_cache``) stays within a
bound computed from the forward's tensor sizes (a first forward used to count every mapped
weight page as activations, scaled by ``max_num_batched_tokens / PROFILE_TOKENS``: 25 GB for
the 0.5B shape). ``getrusage``'s peak, the measure before, hid a run's growth below any
earlier peak of the process, or of its parent (a forked engine inherits it)."""

from __future__ import annotations

import json
import mmap

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.platforms import current_platform
from pagedllm.platforms.cpu import PROFILE_TOKENS
from pagedllm.platforms.cpu_memory import memory_status, peak_growth
from pagedllm.preload.daemon import preload_model
from pagedllm.worker.worker import Worker

MB = 1 << 20
pytestmark = pytest.mark.skipif(current_platform.device_type != "cpu", reason="the CPU platform's measure")

#: Wide MLPs, few tokens' worth of activations: the weights (53 MB in float32) dwarf what
#: a 64-token forward allocates, so counting them (x32) breaks the bound below.
SHAPE = dict(hidden_size=256, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 16
#: What a process's first forward may keep beyond its tensors (measured: 3-4 MiB of heap).
FIRST_FORWARD_SLACK = 8 * MB


def test_a_freed_buffer_counts_after_a_higher_peak():
    big = torch.ones(256 * MB // 4)  # the process peaks higher before the measured run
    del big

    def run():
        # An anonymous mapping: fresh pages whatever the allocator kept from earlier tests.
        buffer = mmap.mmap(-1, 64 * MB)
        torch.frombuffer(buffer, dtype=torch.uint8).fill_(1)
        buffer.close()

    assert peak_growth(run) >= 60 * MB


def test_mapped_file_pages_are_left_out(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x01" * (64 * MB))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

        def run():
            assert int(torch.frombuffer(mapped, dtype=torch.uint8)[:: mmap.PAGESIZE].sum()) == 64 * MB // mmap.PAGESIZE

        before = memory_status()["RssFile"]
        assert peak_growth(run) < 8 * MB
        assert memory_status()["RssFile"] - before >= 60 * MB  # the pages were read in
        mapped.close()


def _activation_bound(hf: dict, dtype_bytes: int) -> int:
    """The most the profiling run may report: twice what a ``PROFILE_TOKENS``-token forward
    holds at once, plus ``FIRST_FORWARD_SLACK``, scaled to ``MAX_NUM_BATCHED_TOKENS`` as the
    platform scales it. Per token: the residual stream and its norm, q/k/v, the attention
    output, the MLP's gate/up and activation, the temporary KV of every layer; plus float32
    logits of ``MAX_NUM_SEQS`` rows and their softmax."""
    h, f = hf["hidden_size"], hf["intermediate_size"]
    kv = hf["num_key_value_heads"] * h // hf["num_attention_heads"]
    per_token = (4 * h + 2 * kv + 3 * f + 2 * kv * hf["num_hidden_layers"]) * dtype_bytes
    logits = 2 * MAX_NUM_SEQS * hf["vocab_size"] * 4
    return (2 * (PROFILE_TOKENS * per_token + logits) + FIRST_FORWARD_SLACK) * MAX_NUM_BATCHED_TOKENS // PROFILE_TOKENS


def test_profile_run_of_mapped_weights_stays_within_the_tensor_bound(checkpoint_factory, tmp_path, monkeypatch):
    checkpoint = checkpoint_factory("LlamaForCausalLM", seed=3, **SHAPE)
    monkeypatch.setenv("PAGEDLLM_PRELOAD_DIR", str(tmp_path))
    args = EngineArgs(model=str(checkpoint), dtype="float32", max_model_len=MAX_NUM_BATCHED_TOKENS,
                      max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS, load_format="ipc_cache")
    preload_model(args)
    worker = Worker(args.create_engine_config(log_choices=False))
    worker.init_device()
    worker.load_model()
    try:
        peak, weights = worker.model_runner.profile_run(), worker.model_runner.weights_bytes
    finally:
        worker.shutdown()
    bound = _activation_bound(json.loads((checkpoint / "config.json").read_text()), 4)
    assert bound < weights * MAX_NUM_BATCHED_TOKENS // PROFILE_TOKENS // 2  # the bound tells weights from activations
    assert peak <= bound
