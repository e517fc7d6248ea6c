"""A mixture-of-experts model over two tensor-parallel workers: each expert split by its
intermediate dimension (``-tp 2``), and whole experts per worker (``--enable-expert-parallel``,
5 experts: 3 and 2), greedy token-identical to transformers (float32) under chunked prefill,
preemption and prefix caching. One engine per mode (workers are slow to start)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import can_host_workers, check_block_accounting
from tests.models.utils import MAX_TOKENS, prompts_for, transformers_greedy

pytestmark = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")

CONFIG = dict(num_hidden_layers=3, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, intermediate_size=64, mlp_only_layers=[1])
#: 64-token steps over 8-token blocks, 16 blocks for ~48 needed: chunks, preemption, prefix hits.
ENGINE_KWARGS = dict(dtype="float32", tensor_parallel_size=2, max_model_len=128, block_size=8,
                     max_num_batched_tokens=64, num_gpu_blocks_override=16)


def _expert_shards(worker) -> list[tuple[int, int, int]]:
    """(first expert, experts, intermediate columns) of each ``FusedMoE`` on ``worker``."""
    from pagedllm.model_executor.layers.fused_moe import FusedMoE

    return [(m.expert_start, m.local_num_experts, m.intermediate_size_per_partition)
            for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]


@pytest.fixture(scope="module")
def qwen2_moe(checkpoint_factory):
    return checkpoint_factory("Qwen2MoeForCausalLM", seed=7, **CONFIG)


@pytest.mark.parametrize("enable_expert_parallel", [False, True], ids=["tp", "ep"])
def test_greedy_equals_transformers_over_two_workers(qwen2_moe, enable_expert_parallel):
    prompts = prompts_for(1024)
    expected = transformers_greedy(qwen2_moe, prompts)
    llm = LLM(str(qwen2_moe), enable_expert_parallel=enable_expert_parallel, **ENGINE_KWARGS)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        cached = []
        for _ in range(2):  # the second pass hits the prefix cache
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == expected * 2
            cached.append(sum(o.num_cached_tokens or 0 for o in outputs))
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0 and cached[1] > 0
        shards = [(0, 3, 32), (3, 2, 32)] if enable_expert_parallel else [(0, 5, 16), (0, 5, 16)]
        assert core.model_executor.collective_rpc(_expert_shards) == [[shard] * 2 for shard in shards]
        check_block_accounting(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
