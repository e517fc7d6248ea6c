"""The state layers' tensor-parallel split in one process: each of two ranks' layers (built with
the group's size and rank patched, weights from the whole layer's tensors through their
loaders) runs a prefill and a decode step on its own states, and the ranks' partial outputs
(summed, as ``out_proj``'s all-reduce does) equal the whole layer's output. Mamba-2 with its B /
C groups split (2 groups) and copied (1 group: the gated norm's mean square gathered over the
ranks, here two threads), the Gated DeltaNet in both projection layouts; and the group
arithmetic of ``mamba.sharding``."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedllm.model_executor.layers import linear as linear_mod
from pagedllm.model_executor.layers.mamba import mamba_mixer2
from pagedllm.model_executor.layers.mamba.abstract import MambaMetadata
from pagedllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2, mamba2_state_shape
from pagedllm.model_executor.layers.mamba.sharding import GroupShards
from pagedllm.model_executor.utils import default_weight_loader
from tests.helpers import as_tensor_parallel_rank
from tests.models.test_qwen3_next import LAYER_CONFIG, LAYOUTS

TP = 2
LENGTHS = (5, 19)  # one prefill step of two requests, then one decode step of both


def _randomized(layer: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random weights for ``layer`` (per-head vectors spread, norms near 1): its checkpoint."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            near_one = name.endswith("norm.weight") or name == "D"
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + (1.0 if near_one else 0.0))
    return {name: t.clone() for name, t in layer.state_dict().items()}


def _load(layer: torch.nn.Module, checkpoint: dict[str, torch.Tensor]) -> None:
    params = dict(layer.named_parameters())
    assert set(params) == set(checkpoint)
    for name, tensor in checkpoint.items():
        getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor)


def _steps(run, hidden: int, seed: int) -> list[torch.Tensor]:
    """The layer's outputs for a prefill of ``LENGTHS`` then a decode step of both requests,
    ``run(x, metadata)`` calling it (its states bound and fresh)."""
    gen = torch.Generator().manual_seed(seed)
    prefill = MambaMetadata(torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32),
                            torch.tensor([2, 0], dtype=torch.int32), torch.tensor([False, False]), 0, 2, sum(LENGTHS))
    decode = MambaMetadata(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32),
                           torch.tensor([True, True]), 2, 0, 0)
    return [run(torch.randn(sum(LENGTHS), hidden, generator=gen), prefill), run(torch.randn(2, hidden, generator=gen),
                                                                                  decode)]


def _threaded_ranks(monkeypatch, make_run):
    """Each rank's outputs from ``make_run(rank)`` (called with the rank's group patched; its
    result runs in a thread of its own), the ranks' all-gathers served across the threads and
    all-reduces left to the caller (each rank's partial sum)."""
    runs = []
    for rank in range(TP):
        as_tensor_parallel_rank(monkeypatch, rank, TP)
        runs.append(make_run(rank))
    barrier, shared, local = threading.Barrier(TP, timeout=60), {}, threading.local()

    def all_gather(x, dim=-1):
        shared[local.rank] = x
        barrier.wait()
        out = torch.cat([shared[r] for r in range(TP)], dim=dim)
        barrier.wait()
        return out

    monkeypatch.setattr(mamba_mixer2, "tensor_model_parallel_all_gather", all_gather)
    monkeypatch.setattr(linear_mod, "tensor_model_parallel_all_reduce", lambda x: x)
    results: dict[int, list[torch.Tensor]] = {}

    def work(rank):
        local.rank = rank
        results[rank] = runs[rank]()

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[rank] for rank in range(TP)]


def _mixer(n_groups: int) -> MambaMixer2:
    return MambaMixer2(32, 64, 8, 8, n_groups, 16, 4, 8, use_conv_bias=True, use_bias=True, rms_norm_eps=1e-5,
                       in_proj_scale=torch.linspace(0.5, 1.5, 2 * 64 + 2 * n_groups * 16 + 8))


def _bind(layer, shapes) -> None:
    layer.kv_cache = [torch.zeros(3, *shape) for shape in shapes]


@pytest.mark.parametrize("n_groups", [2, 1])
def test_mamba2_ranks_sum_to_the_whole_mixer(monkeypatch, n_groups):
    whole = _mixer(n_groups)
    checkpoint = _randomized(whole, seed=n_groups)
    _bind(whole, whole.get_state_shape())

    step_metadata = threading.local()  # each thread's (rank's) step, as the forward context
    monkeypatch.setattr(mamba_mixer2, "get_forward_context", lambda group=0: step_metadata.value)

    def forward(layer):
        def run(x, metadata):
            step_metadata.value = metadata
            return layer(x)
        return run

    expected = _steps(forward(whole), 32, seed=7)

    def make_run(rank):
        layer = _mixer(n_groups)
        _load(layer, checkpoint)
        assert layer.get_state_shape() == mamba2_state_shape(64, n_groups, 8, 8, 16, 4, TP)
        assert (layer.num_heads, layer.n_groups, layer.conv_dim) == (4, max(1, n_groups // TP), 32 + 2 * 16)
        _bind(layer, layer.get_state_shape())
        return lambda: _steps(forward(layer), 32, seed=7)

    partials = _threaded_ranks(monkeypatch, make_run)
    for step, want in enumerate(expected):
        torch.testing.assert_close(partials[0][step] + partials[1][step], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gated_deltanet_ranks_sum_to_the_whole_layer(monkeypatch, layout):
    config_cls, _, layer_cls = LAYOUTS[layout]
    config = config_cls(**LAYER_CONFIG)
    whole = layer_cls(config, None, "linear_attn")
    checkpoint = _randomized(whole, seed=3)

    def mixing(layer):
        states = [torch.zeros(3, *shape) for shape in layer.get_state_shape()]
        return lambda x, metadata: layer.mix(x, *states, metadata)

    expected = _steps(mixing(whole), config.hidden_size, seed=8)

    def make_run(rank):
        layer = layer_cls(config, None, "linear_attn")
        _load(layer, checkpoint)
        assert (layer.num_k_heads, layer.num_v_heads) == (1, 2)
        assert layer.get_state_shape() == ((2 * 16 + 2 * 8, 3), (2, 16, 8))
        return lambda: _steps(mixing(layer), config.hidden_size, seed=8)

    partials = _threaded_ranks(monkeypatch, make_run)
    for step, want in enumerate(expected):
        torch.testing.assert_close(partials[0][step] + partials[1][step], want, rtol=1e-4, atol=1e-5)


def test_group_shards():
    assert GroupShards.of(8, 2, 1) == GroupShards(per_rank=4, part=1, num_parts=2, ranks_per_group=1)
    assert GroupShards.of(2, 4, 3) == GroupShards(per_rank=1, part=1, num_parts=2, ranks_per_group=2)
    assert GroupShards.of(1, 2, 1) == GroupShards(per_rank=1, part=0, num_parts=1, ranks_per_group=2)
    with pytest.raises(ValueError, match="n_groups 3 and tensor_parallel_size 2 must divide one another"):
        GroupShards.of(3, 2, 0)
    assert mamba2_state_shape(64, 1, 8, 8, 16, 4, 2) == ((32 + 2 * 16, 3), (4, 8, 16))
    assert mamba2_state_shape(64, 4, 8, 8, 16, 4, 2) == ((32 + 2 * 2 * 16, 3), (4, 8, 16))
