"""Experts spread over two data-parallel engines (``-dp 2 --enable-expert-parallel``): two
spawned processes joined by gloo, each a ``FusedMoE`` holding its engine's experts (5: 3 and
2), exchanging tokens of different counts (7 and 3; then 4 and none, the idle engine passing
zero tokens through ``run_idle_exchanges``); each engine's outputs equal the unsharded layer's
on its own tokens."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.distributed import initialize_model_parallel
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from tests.helpers import cpu_only, run_spawned_ranks

HIDDEN, INTER, EXPERTS, TOP_K = 16, 24, 5, 2
#: Tokens per engine in each step: both busy (uneven), then engine 1 idle.
STEPS = [(7, 3), (4, 0)]


def _layer(seed: int = 3) -> FusedMoE:
    """A ``FusedMoE`` of this process's placement with every expert offered to its loader."""
    gen = torch.Generator().manual_seed(seed)
    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, prefix="experts", renormalize=True)
    for e in range(EXPERTS):
        for shard, shape in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
            weight = torch.randn(shape, generator=gen) / 4
            layer.weight_loader(layer.w2_weight if shard == "w2" else layer.w13_weight, weight, shard, shard, e)
    assert layer.missing_weights() == []
    return layer


def _inputs(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    n = STEPS[step][rank]
    return torch.randn(n, HIDDEN, generator=gen), torch.randn(n, EXPERTS, generator=gen)


def _rank_main(rank: int, init_method: str, results) -> None:
    from pagedllm.distributed import parallel_state as ps
    from pagedllm.model_executor.layers.fused_moe.layer import run_idle_exchanges

    ps.init_distributed_environment(2, rank, init_method, rank, "gloo")
    ps.initialize_model_parallel(1, 1, enable_expert_parallel=True, data_parallel_size=2)
    layer = _layer()
    out = {"rank": rank, "placement": (layer.expert_start, layer.local_num_experts), "outputs": [], "idle": []}
    with torch.inference_mode():
        for step, counts in enumerate(STEPS):
            if counts[rank]:
                out["outputs"].append(layer(*_inputs(step, rank)).numpy())
            else:
                out["idle"].append(run_idle_exchanges(torch.nn.ModuleList([layer]), torch.float32, torch.device("cpu")))
    out["calls"] = {op: s.calls for op, s in ps.get_comm_stats().items()}
    results.put(out)
    ps.destroy_distributed_environment()


@cpu_only  # gloo
def test_two_engines_exchange_tokens_and_equal_the_unsharded_layer():
    by_rank = run_spawned_ranks(_rank_main, 2)
    assert by_rank[0]["placement"] == (0, 3) and by_rank[1]["placement"] == (3, 2)
    assert by_rank[1]["idle"] == [1] and by_rank[0]["idle"] == []
    # Per step: 4 all-gathers (counts, tokens, ids, weights) and one all-reduce, idle or not.
    assert by_rank[0]["calls"] == by_rank[1]["calls"] == {"all_gather": 8, "all_reduce": 2}
    initialize_model_parallel()  # this process: one engine holding every expert
    reference = _layer()
    assert reference.local_num_experts == EXPERTS
    with torch.inference_mode():
        for rank in range(2):
            busy = [step for step, counts in enumerate(STEPS) if counts[rank]]
            for got, step in zip(by_rank[rank]["outputs"], busy, strict=True):
                expected = reference(*_inputs(step, rank))
                assert expected.abs().max() > 0.1
                torch.testing.assert_close(torch.from_numpy(np.asarray(got)), expected, rtol=1e-5, atol=1e-6)
