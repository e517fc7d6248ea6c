"""Preloaded weights of a tensor- or pipeline-parallel engine: ``preload_model`` at ``-tp 2``
(``-pp 2``) starts that engine's worker processes once and each writes its rank's store; an
engine of the same size (``--load-format ipc_cache``) maps each rank's store in that rank's
worker and gives the greedy tokens of a normal load; an engine of another size is refused,
naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.model_executor.layers.cpu_gemm import pack_weight
from pagedllm.preload import daemon, ipc_cache
from pagedllm.preload.key import store_name
from pagedllm.preload.store import WEIGHTS_FILE
from tests.helpers import can_host_workers, check_block_accounting, random_prompts

pytestmark = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")

ARGS = {"dtype": "float32", "max_model_len": 128, "num_gpu_blocks_override": 32}
SIZES = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 17, 40], 1000, seed=5)]
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    check_block_accounting(llm)
    return outputs


def _mapped_file(worker) -> str:
    """The file that ``worker``'s first plain parameter is mapped from ("" for anonymous memory)."""
    # The first one with storage: a weight packed for oneDNN (the C++ kernels on) is opaque.
    ptr = next(p for p in worker.model_runner.model.parameters() if p.layout == torch.strided).data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= ptr < end:
            return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError("the weight is in no mapping")


@pytest.mark.parametrize("size", SIZES)
def test_each_rank_maps_its_store_and_greedy_matches_a_normal_load(size, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_PRELOAD_DIR", str(tmp_path))
    parallel = SIZES[size]
    engine_args = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=128, **parallel)
    directories = daemon.preload_model(engine_args)
    tp, pp = parallel.get("tensor_parallel_size", 1), parallel.get("pipeline_parallel_size", 1)
    assert [d.name for d in directories] == [store_name(tiny_llama, r % tp, r // tp) for r in range(tp * pp)]
    normal = LLM(str(tiny_llama), **parallel, **ARGS)
    try:
        expected = _greedy(normal)
    finally:
        normal.llm_engine.engine_core.shutdown()
    mapped = LLM(str(tiny_llama), load_format="ipc_cache", **parallel, **ARGS)
    try:
        executor = mapped.llm_engine.engine_core.model_executor
        assert executor.collective_rpc(_mapped_file) == [str(d / WEIGHTS_FILE) for d in directories]
        assert _greedy(mapped) == expected
    finally:
        mapped.llm_engine.engine_core.shutdown()
    one = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=128).create_engine_config(log_choices=False)
    field = "tensor_parallel_size .preloaded: 2" if tp == 2 else "pipeline_parallel_size .preloaded: 2"
    with pytest.raises(ValueError, match=f"do not match this engine: {field}, this engine: 1."):
        ipc_cache.load_preloaded(one.model_config, True, pack_weight)
