"""A mixture-of-experts model over two tensor-parallel workers: each expert split by its
intermediate dimension (``-tp 2``), and whole experts per worker (``--enable-expert-parallel``,
5 experts: 3 and 2), greedy token-identical to transformers (float32) under chunked prefill,
preemption and prefix caching. One engine per mode (workers are slow to start)."""

from __future__ import annotations

import pytest

from tests.helpers import can_host_workers
from tests.models.utils import assert_moe_over_workers, prompts_for

pytestmark = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")

CONFIG = dict(num_hidden_layers=3, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, intermediate_size=64, mlp_only_layers=[1])
#: 64-token steps over 8-token blocks, 16 blocks for ~48 needed: chunks, preemption, prefix hits.
ENGINE_KWARGS = dict(dtype="float32", tensor_parallel_size=2, max_model_len=128, block_size=8,
                     max_num_batched_tokens=64, num_gpu_blocks_override=16)


@pytest.fixture(scope="module")
def qwen2_moe(checkpoint_factory):
    return checkpoint_factory("Qwen2MoeForCausalLM", seed=7, **CONFIG)


@pytest.mark.parametrize("enable_expert_parallel", [False, True], ids=["tp", "ep"])
def test_greedy_equals_transformers_over_two_workers(qwen2_moe, enable_expert_parallel):
    shards = [(0, 3, 32), (3, 2, 32)] if enable_expert_parallel else [(0, 5, 16), (0, 5, 16)]
    assert_moe_over_workers(qwen2_moe, prompts_for(1024), shards, 2, enable_expert_parallel=enable_expert_parallel,
                            **ENGINE_KWARGS)
