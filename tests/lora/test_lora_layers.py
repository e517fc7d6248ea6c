"""``LoRALinearMethod`` adds each token's own adapter update over the wrapped method's
product, for unquantized, int8 and int4 bases, with tokens of several slots and of none mixed,
on the CPU kernel and on the PyTorch path; under tensor parallelism each rank's part of a
column-parallel layer's update is the whole update's columns and the row-parallel ranks'
partial updates add up to the whole one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.lora.layers import LoRALinearMethod, LoRAStepMapping
from pagedllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.quantization.int4 import Int4Config
from pagedllm.model_executor.layers.quantization.int8 import Int8Config
from tests.helpers import as_tensor_parallel_rank


@pytest.mark.parametrize("path", ["cpu_kernel", "torch"])
@pytest.mark.parametrize("quant_config", [None, Int8Config(), Int4Config()], ids=["unquantized", "int8", "int4"])
def test_each_token_gets_its_slots_update(quant_config, path):
    torch.manual_seed(0)
    layer = QKVParallelLinear(128, head_size=8, total_num_heads=4, total_num_kv_heads=2, bias=False,
                              quant_config=quant_config)  # out [q 32 | k 16 | v 16]
    layer.weight.data.copy_(torch.randn(64, 128))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(7, 128)
    base = layer(x)
    mapping = LoRAStepMapping()
    method = LoRALinearMethod(layer.quant_method, layer, 2, 4, mapping, torch.device("cpu"), torch.float32)
    if path == "cpu_kernel" and not method.use_kernel:
        pytest.skip("the C++ CPU kernels are unavailable here")
    method.use_kernel = path == "cpu_kernel"
    layer.quant_method = method
    q = (torch.randn(3, 128), torch.randn(32, 3))
    v = (torch.randn(3, 128), torch.randn(16, 3))
    k = (torch.randn(4, 128), torch.randn(16, 4))
    method.set_slot(0, [q, None, v])
    method.set_slot(1, [None, k, None])
    token_slots = np.array([0, -1, 1, 0, 1, -1, 0])
    mapping.set_token_slots(token_slots)
    assert mapping.groups == [(0, 0, 1), (1, 2, 3), (0, 3, 4), (1, 4, 5), (0, 6, 7)]
    expected = base.clone()
    for t, slot in enumerate(token_slots):
        if slot == 0:
            expected[t, :32] += q[1] @ (q[0] @ x[t])
            expected[t, 48:] += v[1] @ (v[0] @ x[t])
        elif slot == 1:
            expected[t, 32:48] += k[1] @ (k[0] @ x[t])
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    mapping.set_token_slots(np.full(7, 1))  # one slot for every token: one run
    assert mapping.groups == [(1, 0, 7)]
    expected_all = base.clone()
    expected_all[:, 32:48] += x @ k[0].T @ k[1].T
    torch.testing.assert_close(layer(x), expected_all, rtol=1e-5, atol=1e-4)
    mapping.set_token_slots(np.full(7, -1))
    torch.testing.assert_close(layer(x), base)
    with pytest.raises(ValueError, match="rank <= 4"):
        method.set_slot(0, [(torch.randn(5, 128), torch.randn(32, 5)), None, None])


#: The token groups every layer of ``_qkv_and_o`` reads.
MAPPING = LoRAStepMapping()


def _qkv_and_o(monkeypatch, rank: int, tp: int):
    """The q/k/v (hidden 32 -> 4 heads + 2 KV heads of 8) and o (32 -> 32, partial sums)
    layers of tensor-parallel rank ``rank`` of ``tp``, each wrapped in a LoRA method of 1 slot."""
    as_tensor_parallel_rank(monkeypatch, rank, tp)
    qkv = QKVParallelLinear(32, head_size=8, total_num_heads=4, total_num_kv_heads=2, bias=False)
    o_proj = RowParallelLinear(32, 32, bias=False, reduce_results=False)
    for layer in (qkv, o_proj):
        layer.quant_method = LoRALinearMethod(layer.quant_method, layer, 1, 4, MAPPING, torch.device("cpu"),
                                              torch.float32)
    return qkv, o_proj


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4_kv_heads_replicated"])
def test_tensor_parallel_parts_make_the_whole_update(monkeypatch, tp):
    """Column-parallel: each rank's outputs (q heads, its KV head) are the whole layer's
    columns; row-parallel: the ranks' partial outputs sum to the whole layer's output."""
    torch.manual_seed(1)
    w_qkv, w_o = torch.randn(64, 32), torch.randn(32, 32)
    q, k = (torch.randn(3, 32), torch.randn(32, 3)), (torch.randn(2, 32), torch.randn(16, 2))
    o = (torch.randn(4, 32), torch.randn(32, 4))
    x, attn = torch.randn(5, 32), torch.randn(5, 32)
    MAPPING.set_token_slots(np.array([0, -1, 0, 0, -1]))

    def build(rank: int, size: int):
        qkv, o_proj = _qkv_and_o(monkeypatch, rank, size)
        for shard_id, rows in zip("qkv", w_qkv.split([32, 16, 16])):
            qkv.weight_loader(qkv.weight, rows, shard_id)
        o_proj.weight_loader(o_proj.weight, w_o)
        for layer in (qkv, o_proj):
            layer.quant_method.process_weights_after_loading(layer)
        qkv.quant_method.set_slot(0, [q, k, None])
        o_proj.quant_method.set_slot(0, [o])
        return qkv, o_proj

    whole_qkv, whole_o = build(0, 1)
    whole_y, whole_out = whole_qkv(x), whole_o(attn)
    partial_sum = torch.zeros_like(whole_out)
    q_width, replicas = 32 // tp, max(1, tp // 2)
    for rank in range(tp):
        qkv, o_proj = build(rank, tp)
        y = qkv(x)
        head = rank // replicas  # this rank's KV head
        expected = torch.cat([whole_y[:, rank * q_width:(rank + 1) * q_width],
                              whole_y[:, 32 + head * 8:40 + head * 8], whole_y[:, 48 + head * 8:56 + head * 8]], dim=1)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
        partial_sum += o_proj(attn[:, rank * (32 // tp):(rank + 1) * (32 // tp)])
    torch.testing.assert_close(partial_sum, whole_out, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(whole_out, attn @ w_o.T, atol=1e-2)  # the update is there


def test_bfloat16_model_keeps_slots_in_bfloat16_on_both_paths():
    """A bfloat16 model's slots are bfloat16 (half the bytes); the CPU kernel and the PyTorch
    path give the same update, within bfloat16 rounding of the float64 reference."""
    torch.manual_seed(0)
    layer = QKVParallelLinear(128, head_size=8, total_num_heads=4, total_num_kv_heads=2, bias=False,
                              params_dtype=torch.bfloat16)
    layer.weight.data.copy_(torch.randn(64, 128))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(6, 128).to(torch.bfloat16)
    base = layer(x)
    mapping = LoRAStepMapping()
    method = LoRALinearMethod(layer.quant_method, layer, 2, 4, mapping, torch.device("cpu"), torch.bfloat16)
    assert method.lora_a.dtype == method.lora_b.dtype == torch.bfloat16
    layer.quant_method = method
    q = (torch.randn(4, 128), torch.randn(32, 4))
    method.set_slot(1, [q, None, None])
    mapping.set_token_slots(np.array([1, 1, -1, 1, 1, 1]))
    a, b = (t.to(torch.bfloat16).double() for t in q)
    expected = base.double()
    expected[[0, 1, 3, 4, 5], :32] += x[[0, 1, 3, 4, 5]].double() @ a.T @ b.T
    outputs = {}
    for use_kernel in ([True, False] if method.use_kernel else [False]):
        method.use_kernel = use_kernel
        outputs[use_kernel] = layer(x)
        torch.testing.assert_close(outputs[use_kernel].double(), expected, rtol=1.6e-2, atol=5e-2)
    if len(outputs) == 2:
        torch.testing.assert_close(outputs[True], outputs[False], rtol=1.6e-2, atol=5e-2)
