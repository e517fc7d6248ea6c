"""The tensor-parallel group of one process: its size and rank, the collectives as
identities, the refusal of larger groups, and the arithmetic of splitting across ranks."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    initialize_model_parallel,
    kv_heads_per_rank,
    parallel_state,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


def test_a_group_of_one_process():
    initialize_model_parallel()
    initialize_model_parallel(tensor_model_parallel_size=1)
    assert get_tensor_model_parallel_world_size() == 1
    assert get_tensor_model_parallel_rank() == 0
    x = torch.randn(3, 5)
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x) is x


def test_larger_groups_are_refused():
    with pytest.raises(NotImplementedError, match="tensor_model_parallel_size=2: tensor parallelism is not supported yet"):
        initialize_model_parallel(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="at least 1, got 0"):
        initialize_model_parallel(tensor_model_parallel_size=0)
    assert get_tensor_model_parallel_world_size() == 1


def test_collectives_refuse_a_group_they_cannot_serve(monkeypatch):
    monkeypatch.setattr(parallel_state, "_tp_world_size", 2)
    with pytest.raises(NotImplementedError, match="all_reduce over 2 tensor-parallel ranks"):
        tensor_model_parallel_all_reduce(torch.zeros(1))
    with pytest.raises(NotImplementedError, match="all_gather over 2"):
        tensor_model_parallel_all_gather(torch.zeros(1))


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
