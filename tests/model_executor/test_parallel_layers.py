"""The parallel layers' weight loaders put each checkpoint tensor's rows (or columns) for
this rank in the right place of the fused weight, at tensor-parallel size 1 (everything)
and, with the group's size and rank patched, as rank 1 of 2 — including KV heads replicated
when there are more ranks than KV heads; the vocabulary-parallel embedding looks up only its
own rows; bad shapes and shard ids are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.selector import set_attn_backend
from pagedllm.model_executor.layers import linear as linear_mod
from pagedllm.model_executor.layers import vocab_parallel_embedding as vocab_mod
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from tests.helpers import as_tensor_parallel_rank


@pytest.fixture
def rank_1_of_2(monkeypatch):
    as_tensor_parallel_rank(monkeypatch, 1, 2)


def _rows(n: int, k: int, start: float = 0.0) -> torch.Tensor:
    """[n, k] whose row i holds start + i everywhere: slices show which rows went where."""
    return (torch.arange(n, dtype=torch.float32) + start)[:, None].expand(n, k).contiguous()


def _load(layer, shards: dict) -> None:
    for shard_id, tensor in shards.items():
        layer.weight_loader(layer.weight, tensor, shard_id)


def test_qkv_loader_stacks_q_k_v():
    layer = linear_mod.QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=2, bias=True)
    assert (layer.num_heads, layer.num_kv_heads, layer.q_size, layer.kv_size) == (4, 2, 8, 4)
    q, k, v = _rows(8, 8), _rows(4, 8, 100), _rows(4, 8, 200)
    _load(layer, {"v": v, "q": q, "k": k})
    assert torch.equal(layer.weight, torch.cat([q, k, v]))
    layer.weight_loader(layer.bias, torch.arange(4.0) + 10, "k")
    assert torch.equal(layer.bias[8:12], torch.arange(4.0) + 10)


def test_merged_loader_stacks_gate_up():
    layer = linear_mod.MergedColumnParallelLinear(6, [5, 5], bias=False)
    gate, up = _rows(5, 6), _rows(5, 6, 50)
    _load(layer, {1: up, 0: gate})
    assert torch.equal(layer.weight, torch.cat([gate, up]))
    assert layer.output_size_per_partition == 10


def test_fused_checkpoint_tensor_loads_whole():
    layer = linear_mod.MergedColumnParallelLinear(6, [4, 2], bias=False)
    fused = _rows(6, 6)
    layer.weight_loader(layer.weight, fused)
    assert torch.equal(layer.weight, fused)
    with pytest.raises(ValueError, match="should be 4 \\+ 2"):
        layer.weight_loader(layer.weight, _rows(7, 6))


def test_bad_shapes_and_shard_ids_are_refused():
    layer = linear_mod.QKVParallelLinear(8, 2, 4, 2, bias=False)
    with pytest.raises(ValueError, match="Unknown shard id 'x'"):
        layer.weight_loader(layer.weight, _rows(8, 8), "x")
    with pytest.raises(ValueError, match="dimension 0 should be"):
        layer.weight_loader(layer.weight, _rows(6, 8), "k")
    with pytest.raises(ValueError, match="parameter shape"):
        layer.weight_loader(layer.weight, _rows(8, 7), "q")
    row = linear_mod.RowParallelLinear(6, 4, bias=False)
    with pytest.raises(ValueError, match="dimension 1 should be"):
        row.weight_loader(row.weight, _rows(4, 5))


def test_rank_1_of_2_takes_its_rows_and_columns(rank_1_of_2):
    qkv = linear_mod.QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=2, bias=False)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_head_replicas) == (2, 1, 1)
    assert qkv.weight.shape == (2 * 2 + 2 * 2, 8)
    q, k, v = _rows(8, 8), _rows(4, 8, 100), _rows(4, 8, 200)
    _load(qkv, {"q": q, "k": k, "v": v})
    assert torch.equal(qkv.weight, torch.cat([q[4:], k[2:], v[2:]]))

    merged = linear_mod.MergedColumnParallelLinear(6, [4, 4], bias=True)
    gate, up = _rows(4, 6), _rows(4, 6, 50)
    _load(merged, {0: gate, 1: up})
    assert torch.equal(merged.weight, torch.cat([gate[2:], up[2:]]))
    merged.weight_loader(merged.bias, torch.arange(4.0), 1)
    assert torch.equal(merged.bias[2:], torch.tensor([2.0, 3.0]))
    fused = linear_mod.MergedColumnParallelLinear(6, [4, 4], bias=False)
    fused.weight_loader(fused.weight, torch.cat([gate, up]))
    assert torch.equal(fused.weight, merged.weight)

    row = linear_mod.RowParallelLinear(6, 4, bias=True)
    row.weight_loader(row.weight, torch.arange(6.0).expand(4, 6).contiguous())  # column j holds j
    assert torch.equal(row.weight[0], torch.tensor([3.0, 4.0, 5.0]))
    row.weight_loader(row.bias, torch.arange(4.0))
    assert torch.equal(row.bias, torch.arange(4.0))  # the bias is whole (added on rank 0)

    column = linear_mod.ColumnParallelLinear(6, 4, bias=False)
    column.weight_loader(column.weight, _rows(4, 6))
    assert torch.equal(column.weight[:, 0], torch.tensor([2.0, 3.0]))


def test_kv_heads_replicated_when_ranks_outnumber_them(monkeypatch):
    q, k = _rows(8, 8), _rows(4, 8, 100)
    for rank, kv_rows in [(0, k[:2]), (1, k[:2]), (2, k[2:]), (3, k[2:])]:
        as_tensor_parallel_rank(monkeypatch, rank, 4)
        layer = linear_mod.QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=2, bias=False)
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (1, 1, 2)
        _load(layer, {"q": q, "k": k, "v": k})
        assert torch.equal(layer.weight, torch.cat([q[2 * rank : 2 * rank + 2], kv_rows, kv_rows]))


def test_vocab_parallel_embedding_looks_up_its_own_rows(rank_1_of_2, monkeypatch):
    embed = vocab_mod.VocabParallelEmbedding(10, 3)
    assert (embed.vocab_start_index, embed.vocab_end_index) == (5, 10)
    embed.weight_loader(embed.weight, _rows(10, 3))
    assert torch.equal(embed.weight[:, 0], torch.arange(5.0, 10.0))
    monkeypatch.setattr(vocab_mod, "tensor_model_parallel_all_reduce", lambda x: x)  # this rank's part of the sum
    out = embed(torch.tensor([2, 7, 9, 4]))
    assert torch.equal(out[:, 0], torch.tensor([0.0, 7.0, 9.0, 0.0]))
    with pytest.raises(ValueError, match="11 is not divisible by 2"):
        vocab_mod.VocabParallelEmbedding(11, 3)


def test_model_holds_this_ranks_heads(rank_1_of_2):
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=100)
    with set_attn_backend(TorchSDPABackend):
        model = LlamaForCausalLM(config)
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1, 2, 1)
    assert attn.qkv_proj.weight.shape == ((2 + 2 * 1) * 16, 64)
    assert attn.o_proj.weight.shape == (64, 32)
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (160, 64)
    assert model.lm_head.weight.shape == (50, 64)
