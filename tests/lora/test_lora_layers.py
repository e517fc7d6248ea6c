"""``LoRALinearMethod`` adds each token's own adapter update over the wrapped method's
product, for unquantized, int8 and int4 bases, with tokens of several slots and of none mixed,
on the CPU kernel and on the PyTorch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.lora.layers import LoRALinearMethod, LoRAStepMapping
from pagedllm.model_executor.layers.linear import QKVParallelLinear
from pagedllm.model_executor.layers.quantization.int4 import Int4Config
from pagedllm.model_executor.layers.quantization.int8 import Int8Config


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
    method = LoRALinearMethod(layer.quant_method, layer, 2, 4, mapping, torch.device("cpu"))
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
