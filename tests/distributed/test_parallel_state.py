"""Model-parallel groups: a group of one process (collectives are identities); four spawned
processes joined by gloo as tp=2 x pp=2 (vLLM's rank layout; all-reduce and all-gather
through shared memory and through gloo, in pieces larger than a slot; all-reduce
bit-identical on every rank, all-gather in rank order); the refusals; and the arithmetic of splitting across ranks."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from pagedllm.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    initialize_model_parallel,
    kv_heads_per_rank,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tests.helpers import cpu_only, run_spawned_ranks


def test_a_group_of_one_process():
    initialize_model_parallel()
    initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    assert get_tensor_model_parallel_world_size() == 1
    assert get_tensor_model_parallel_rank() == 0
    x = torch.randn(3, 5)
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x) is x


def test_sizes_that_do_not_match_the_world_are_refused():
    with pytest.raises(ValueError, match="tensor_model_parallel_size 2 x pipeline_model_parallel_size 1 != world size 1"):
        initialize_model_parallel(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="must be at least 1"):
        initialize_model_parallel(tensor_model_parallel_size=0)
    assert get_tensor_model_parallel_world_size() == 1


def _rank_main(rank: int, init_method: str, results) -> None:
    from pagedllm.distributed import parallel_state as ps
    from pagedllm.distributed.shm_communicator import ShmCommunicator

    ps.init_distributed_environment(4, rank, init_method, rank, "gloo")
    ps.initialize_model_parallel(2, 2)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    x = torch.randn(3, 896, generator=torch.Generator().manual_seed(rank))
    gloo = ps.GroupCoordinator(tp.ranks, rank, tp.device_group)
    # 10 float32 per slot: a [3, 896] input goes through in 269 pieces.
    tiny_slots = ps.GroupCoordinator(tp.ranks, rank, tp.device_group, ShmCommunicator(tp.device_group, tp.ranks, 40))
    out = {
        "rank": rank,
        "tp_ranks": tp.ranks, "pp_ranks": pp.ranks,
        "tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "uses_shm": tp.shm is not None,
        "x": x,
        "shm": ps.tensor_model_parallel_all_reduce(x),
        "gloo": gloo.all_reduce(x.clone()),
        "pieces": tiny_slots.all_reduce(x),
        "gather": ps.tensor_model_parallel_all_gather(x, dim=-1),
        "gather_gloo": gloo.all_gather(x, dim=0),
        "gather_pieces": tiny_slots.all_gather(x, dim=0),
        "stats": {op: s.calls for op, s in ps.get_comm_stats().items()},
    }
    # Tensors as numpy arrays, pickled by value: torch would share them by file descriptor,
    # which the parent cannot fetch any more once this process has exited.
    results.put({k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in out.items()})
    tiny_slots.destroy()
    ps.destroy_distributed_environment()


@cpu_only  # the CPU collectives: gloo, shared memory
def test_tp2_pp2_groups_and_collectives(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_COLLECTIVES", "shm")
    by_rank = {rank: {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}
               for rank, out in run_spawned_ranks(_rank_main, 4).items()}
    for rank, out in by_rank.items():
        pp_rank, tp_rank = divmod(rank, 2)  # rank = pp_rank x tp + tp_rank
        assert out["tp_ranks"] == [2 * pp_rank, 2 * pp_rank + 1] and out["tp_rank"] == tp_rank
        assert out["pp_ranks"] == [tp_rank, tp_rank + 2] and out["pp_rank"] == pp_rank
        assert out["uses_shm"]
        peers = [by_rank[r]["x"] for r in out["tp_ranks"]]
        expected = peers[0] + peers[1]
        for impl in ("shm", "gloo", "pieces"):
            torch.testing.assert_close(out[impl], expected, rtol=0, atol=1e-6)
        assert torch.equal(out["gather"], torch.cat(peers, dim=-1))
        assert torch.equal(out["gather_gloo"], torch.cat(peers, dim=0))
        assert torch.equal(out["gather_pieces"], torch.cat(peers, dim=0))
        assert out["stats"] == {"all_reduce": 3, "all_gather": 3}  # the collectives above
        partner = by_rank[out["tp_ranks"][1 - tp_rank]]
        for impl in ("shm", "gloo", "pieces"):  # the partner got exactly the same bits
            assert torch.equal(out[impl], partner[impl])


def test_divide():
    assert divide(12, 4) == 3
    assert divide(7, 1) == 7
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        divide(10, 4)
    with pytest.raises(ValueError, match="not divisible by 0"):
        divide(10, 0)


@pytest.mark.parametrize("total, tp_size, expected", [(8, 1, 8), (8, 2, 4), (8, 8, 1), (2, 4, 1), (1, 8, 1)])
def test_kv_heads_per_rank(total, tp_size, expected):
    assert kv_heads_per_rank(total, tp_size) == expected


@pytest.mark.parametrize("total, tp_size", [(8, 3), (3, 4)])
def test_kv_heads_that_do_not_split(total, tp_size):
    with pytest.raises(ValueError, match="not divisible"):
        kv_heads_per_rank(total, tp_size)
