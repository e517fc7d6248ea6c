"""``KVLayout``: read from the cache tensors of both layouts, sent as JSON, compared field by
field (block size told, not compared); a descriptor that is not one is refused."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed.kv_transfer.layout import KVLayout, mismatch_message


def test_layout_of_both_cache_layouts_and_its_mismatches():
    kv = KVLayout.of([torch.zeros(2, 5, 16, 2, 8)] * 4, 16, "LlamaForCausalLM", 1, 1)
    assert (kv.num_layers, kv.num_kv_heads, kv.head_size, kv.kv_cache_dtype, kv.block_size) == (4, 2, 8, "float32", 16)
    mla = KVLayout.of([torch.zeros(5, 32, 24, dtype=torch.bfloat16)] * 3, 32, "DeepseekV2ForCausalLM", 2, 1)
    assert (mla.num_layers, mla.num_kv_heads, mla.head_size, mla.kv_cache_dtype) == (3, 0, 24, "bfloat16")
    assert KVLayout.from_json(kv.to_json()) == kv
    other_blocks = KVLayout.of([torch.zeros(2, 9, 32, 2, 8)] * 4, 32, "LlamaForCausalLM", 1, 1)
    assert kv.mismatches(other_blocks) == []
    tp2 = KVLayout.of([torch.zeros(2, 5, 16, 1, 8)] * 4, 16, "LlamaForCausalLM", 2, 1)
    assert kv.mismatches(tp2) == [("num_kv_heads", 2, 1), ("tensor_parallel_size", 1, 2)]
    message = mismatch_message(kv.mismatches(tp2), "here", "there")
    assert message.startswith("KV layout mismatch: num_kv_heads is 2 on here, 1 on there; tensor_parallel_size is "
                              "1 on here, 2 on there. ")


@pytest.mark.parametrize("data", [b"{", b'{"model": "x"}', b"[1]"])
def test_a_descriptor_that_is_not_a_layout_is_refused(data):
    with pytest.raises(ValueError, match="not a KV layout descriptor"):
        KVLayout.from_json(data)
